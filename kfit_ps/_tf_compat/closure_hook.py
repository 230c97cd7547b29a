"""Seeing each function a `ClusterCoordinator` runs: which worker, how long, whether it
finished.

TensorFlow's coordinator keeps its own timing metrics (`metric_utils`) per
process, not per worker, and switched off unless its monitoring is read.
Each of its `Worker` objects runs `_process_closure(closure)` on its own
thread, once per scheduled function: executing it on the worker and copying
its result to the chief. `observe_closures` wraps that method on each worker
of a coordinator, and calls `on_done(worker_index, remote_value, seconds)`
once the result is in (not when the function was put back to run elsewhere
after a worker failure: it is observed where it finishes).
"""

import time

from tensorflow.python.distribute.coordinator import remote_value as remote_value_lib

_READY = remote_value_lib.RemoteValueStatus.READY
_OBSERVED = "_kfit_ps_observed"


def observe_closures(coordinator, on_done):
    """Calls `on_done(worker_index, remote_value, seconds)` after each function a worker of
    `coordinator` finishes; idempotent per worker."""
    for worker in coordinator._cluster.workers:
        if getattr(worker, _OBSERVED, None) is on_done:
            continue
        original = type(worker)._process_closure.__get__(worker)

        def process(closure, worker=worker, original=original):
            start = time.perf_counter()
            original(closure)
            ref = getattr(closure, "_output_remote_value_ref", None)
            value = ref() if ref is not None else None
            if value is not None and getattr(value, "_status", None) is _READY and getattr(
                    value, "_error", None) is None:  # (a failed function is READY too)
                on_done(worker.worker_index, value, time.perf_counter() - start)

        worker._process_closure = process
        setattr(worker, _OBSERVED, on_done)
