"""Eager executors that end quietly when the task their pending ops ran on was lost.

TensorFlow's `Executor.__del__` waits for the executor's pending nodes, then
deletes it; it suppresses only `TypeError`. When a ps or worker that an
asynchronous executor still had ops queued for is lost (seen with a ps that
stopped answering and was then killed: "Connection reset by peer" on
`EagerService/Enqueue`), the wait raises that `UnavailableError`, and Python
prints it from `__del__` as "Exception ignored in" with TensorFlow's gRPC error
text, once per executor, after kfit_ps has already handled the loss.

`install_quiet_executor_teardown()` wraps `Executor.__del__`: an `OpError` from
the wait is dropped (the loss is the coordinator's to report, and has been);
anything else, and the stock behaviour otherwise, are unchanged.
"""

import functools
import threading

import tensorflow as tf
from tensorflow.python.eager.executor import Executor

from kfit_ps._tf_compat.versions import check_versions

_install_lock = threading.Lock()


def _quiet_del(stock):
    @functools.wraps(stock)
    def __del__(self, _op_error=tf.errors.OpError):  # Bound now: at exit `tf` may be gone.
        try:
            stock(self)
        except _op_error:
            pass  # Its ops' task was lost; the coordinator reported that already.

    __del__._kfit_ps_stock = stock
    return __del__


def install_quiet_executor_teardown():
    """Installs the quiet teardown once per process; idempotent and thread-safe."""
    with _install_lock:
        if hasattr(Executor.__del__, "_kfit_ps_stock"):
            return
        check_versions()
        Executor.__del__ = _quiet_del(Executor.__del__)
