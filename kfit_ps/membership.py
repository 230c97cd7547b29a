"""Which workers a job has now: the launcher's word to the chief, and a scale request.

Files in one local directory (`RUN_DIR/membership`, named to the chief by
`KFIT_PS_MEMBERSHIP`), each published as data, then marker:

- `request-<n>.json` + `.ready`: "scale to N workers" (`kfit-ps scale`,
  `kfit_ps.scale`); the launcher takes the newest request and removes the rest.
- `<generation>.json` + `.ready`: the launcher's worker list
  (`{"generation": g, "workers": ["host:port", ...]}`), from `kfit-ps scale`
  (`launch.scaling`) or from DNS (`launch.discovery`). Generations grow; the
  chief applies the newest at its next safe point (`kfit_ps.training.resilience.elastic`).
- `<generation>.applied`: the chief now trains on exactly that list. The
  launcher stops a removed worker only after this marker (or once the chief that
  could still use it is gone), so a worker is never stopped with a step in it.

No TensorFlow here: the launcher uses it, and loads TensorFlow only to delete remote
(gs://) backups. The directory is on the local disk of the chief's host, where the
launcher runs.
"""

import json
import os
import time

DIR_NAME = "membership"
_READY = ".ready"
_APPLIED = ".applied"


def _write(path, data):
    """Data, then marker: a reader sees the file only once the marker exists."""
    with open(path, "w") as f:
        json.dump(data, f)
    with open(path + _READY, "w"):
        pass


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _published(directory, prefix=""):
    """The `<name>.json` files of `directory` whose marker exists, by name."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n[:-len(_READY)] for n in names
                  if n.startswith(prefix) and n.endswith(".json" + _READY))


def reset(directory):
    """An empty `directory` for a new job: a run directory reused after a scaled job holds
    the old job's worker lists, whose workers (and ports) are gone."""
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        try:
            os.remove(os.path.join(directory, name))
        except FileNotFoundError:
            pass


def request_scale(run_dir, workers):
    """Asks the launcher of the job in `run_dir` (`kfit-ps run`) for `workers` workers.

    Returns at once; the launcher starts the new workers, the chief takes them at
    its next safe point, and a removed worker is stopped once the chief has let
    it go. The launcher says each step on its output and in the event log.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"scale: `workers` must be an integer >= 1. Received: workers="
                         f"{workers!r}. Pass the number of workers the job should have.")
    directory = os.path.join(run_dir, DIR_NAME)
    if not os.path.isdir(directory):
        raise ValueError(
            f"scale: {run_dir!r} is not the run directory of a job that `kfit-ps run` is "
            f"running (it has no {DIR_NAME}/ folder). Received: run_dir={run_dir!r}. Pass "
            "the --run-dir the launcher printed at its start.")
    _write(os.path.join(directory, f"request-{time.time_ns():020d}.json"),
           {"workers": workers})


def take_request(directory):
    """The newest scale request's worker count (removing every request), or None."""
    names = _published(directory, "request-")
    if not names:
        return None
    data = _read(os.path.join(directory, names[-1]))
    for name in names:
        for suffix in ("", _READY):
            try:
                os.remove(os.path.join(directory, name + suffix))
            except FileNotFoundError:
                pass
    return None if data is None else data.get("workers")


def publish(directory, generation, workers):
    """The launcher's worker list, as generation `generation`."""
    os.makedirs(directory, exist_ok=True)
    _write(os.path.join(directory, f"{generation:08d}.json"),
           {"generation": generation, "workers": list(workers)})


def latest(directory):
    """`(generation, workers)` of the newest published worker list, or None."""
    names = [n for n in _published(directory) if not n.startswith("request-")]
    for name in reversed(names):
        data = _read(os.path.join(directory, name))
        if data is not None:
            return data["generation"], list(data["workers"])
    return None


def acknowledge(directory, generation):
    """The chief: generation `generation` is the one it trains on now."""
    with open(os.path.join(directory, f"{generation:08d}.json{_APPLIED}"), "w"):
        pass


def applied(directory, generation):
    """Whether the chief has taken generation `generation` (or a newer one)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    return any(n.endswith(_APPLIED) and int(n.split(".")[0]) >= generation for n in names)
