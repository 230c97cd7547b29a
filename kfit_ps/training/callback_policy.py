"""Which Keras callbacks parameter-server `fit` runs, and with what semantics.

Epoch-level hooks (`on_train_begin/end`, `on_epoch_begin/end`,
`on_test_begin/end`, ...) behave exactly as in Keras: they run on the
coordinator after the epoch's single synchronisation, with exact logs.

Batch-level hooks run on the coordinator once per *scheduled function*
(every `steps_per_execution` steps), when it is dispatched, with
`batch` = index of the first (`on_*_batch_begin`) or last (`on_*_batch_end`)
step in it. Their `logs` are empty: values are only known after a
synchronisation, and kfit_ps never synchronises per batch. The exceptions
are the `on_train_batch_end` calls made right after a synchronisation: at
each epoch end, and at every step where a `kfit_ps.callbacks.SyncCallback`
asked for one. Those carry the epoch's exact logs so far (so `TerminateOnNaN`
stops training at the next synchronisation).

Stock Keras callbacks that would act every N batches on stale or missing
values are refused at the start of `fit` instead of silently misbehaving;
the error names the kfit_ps callback that does it right.
"""

import keras

from kfit_ps.training.callbacks.base import SyncCallback


def _refusal(callback, attribute, value, fix):
    fix = f"{fix} or kfit_ps.callbacks.{type(callback).__name__}({attribute}=N), which " \
          "synchronises every N steps before acting."
    return ValueError(
        f"{type(callback).__name__}({attribute}={value!r}) acts every N batches, which "
        "parameter-server `fit` does not synchronise on: it would read weights while steps are "
        f"still in flight. Received: {attribute}={value!r}. {fix}"
    )


def check_callbacks(callbacks):
    """Raises ValueError naming the first callback that cannot run correctly."""
    for cb in callbacks or ():
        if not isinstance(cb, keras.callbacks.Callback):
            raise ValueError(
                f"`callbacks` must contain keras.callbacks.Callback instances. Received: {cb!r} "
                f"of type {type(cb).__name__}."
            )
        if isinstance(cb, SyncCallback):
            continue
        if isinstance(cb, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
            if cb.save_freq != "epoch" and cb.save_freq is not False:
                raise _refusal(cb, "save_freq", cb.save_freq, 'Use save_freq="epoch"')
        if isinstance(cb, keras.callbacks.TensorBoard):
            if cb.update_freq != "epoch":
                raise _refusal(cb, "update_freq", cb.update_freq, 'Use update_freq="epoch"')
