"""Progress display for parameter-server `fit`, without a synchronisation per batch.

Scheduling returns at once, so "batches scheduled" says nothing about
progress. Instead, while the coordinator waits in `join()`, a helper thread
polls a step counter that lives on a ps (the optimizer's `iterations`, which
kfit_ps updates atomically) every `KFIT_PS_PROGRESS_INTERVAL` seconds. Each
poll is one small variable read; workers never wait for it.
"""

import contextlib
import logging
import threading

from keras.utils import Progbar

from kfit_ps import _tf_compat, constants

log = logging.getLogger("kfit_ps.training")
_JOIN_SECONDS = 5.0


def resolve_verbose(verbose):
    if verbose == "auto":
        return 1
    if verbose not in (0, 1, 2):
        raise ValueError(
            f"`verbose` must be 'auto', 0, 1 or 2. Received: verbose={verbose!r}. "
            "0 is silent, 1 shows a live progress bar, 2 prints one line per epoch."
        )
    return verbose


class Progress:
    """One progress bar per epoch (verbose 1: live; verbose 2: a line at the end)."""

    def __init__(self, verbose, epochs, steps):
        self.verbose = resolve_verbose(verbose)
        self.epochs = epochs
        self.steps = steps
        self._bar = None
        self._stop = threading.Event()
        self._thread = None

    def epoch_begin(self, epoch, counter=None):
        if not self.verbose:
            return
        if self.epochs > 1:
            _tf_compat.print_msg(f"Epoch {epoch + 1}/{self.epochs}")
        self._bar = Progbar(target=self.steps, verbose=self.verbose)
        if self.verbose == 1 and counter is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, args=(counter,),
                                            name="kfit_ps-progress", daemon=True)
            self._thread.start()

    def _poll(self, counter):
        interval = constants.progress_interval()
        while not self._stop.wait(interval):
            try:
                done = counter()
            except Exception:  # noqa: BLE001 - a failed poll must never break training
                continue
            if done is not None and 0 < done < self.steps and not self._stop.is_set():
                self._bar.update(done)

    def stop_polling(self):
        """Stops the polling thread; idempotent (call it in a `finally`).

        Waits at most `_JOIN_SECONDS`: a poll can be stuck in a read from a
        ps that died. The thread is then left behind (it is a daemon, and
        draws nothing once stopped).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_JOIN_SECONDS)
            if self._thread.is_alive():
                log.warning("kfit_ps: the progress bar's read of the step counter did not "
                            "return within %.0f s (a ps may be unreachable); continuing "
                            "without it.", _JOIN_SECONDS)
            self._thread = None

    @contextlib.contextmanager
    def joining(self):
        """Wraps the epoch's `join()`: stops polling, and ends a half-drawn bar on error."""
        failed = True
        try:
            yield
            failed = False
        finally:
            self.stop_polling()  # first: no poll may draw after the line is ended
            if failed:
                if self._bar is not None and self.verbose == 1:
                    _tf_compat.print_msg("")  # the traceback starts on its own line
                self._bar = None

    def epoch_end(self, logs):
        self.stop_polling()
        if self._bar is not None:
            self._bar.update(self.steps, values=list(logs.items()), finalize=True)
            self._bar = None
