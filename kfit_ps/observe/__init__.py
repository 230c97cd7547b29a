"""Seeing a job while it runs: metrics, events, diagnosis and the status page.

- `metrics`: the one table of metric names, kinds and labels (Prometheus
  text format through `prometheus-client`), labelled by `job`, `task_type`
  and `task_index` only (plus a bounded `reason` on restarts).
- `events`: the one table of event kinds and the JSON-lines event log of a
  job (`events.jsonl` in the run directory of `kfit-ps run`).
- `diagnosis`: which worker straggles and which ps is hot, from per-worker
  steps and per-ps CPU over a sliding window.
- `usage`: a process's CPU seconds and resident memory, from `/proc` text
  (read on the task itself) or `psutil`.
- `http`: the small HTTP server of the chief (`/metrics`) and of the launcher
  (`/`, `/metrics`, `/status.json`); `page`: the status page.

This layer imports neither TensorFlow nor Keras, and neither does the package
root (`import kfit_ps`): the launcher serves it without ever loading them
(`tests/test_public_api.py` checks the launcher's modules in a fresh
interpreter).
"""
