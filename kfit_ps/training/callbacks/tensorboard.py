"""`TensorBoard` scalars for parameter-server training."""

import tensorflow as tf

from kfit_ps import validation
from kfit_ps.training.callbacks import checkpoint_files, summaries
from kfit_ps.training.callbacks.base import SyncCallback, sync_every_from
from kfit_ps.training.monitor import job_monitor


class TensorBoard(SyncCallback):
    """Writes training and validation scalars for TensorBoard.

    Epoch scalars (`epoch_<metric>`, step = epoch) go to `log_dir/train` and
    `log_dir/validation`, as with `keras.callbacks.TensorBoard`; validation
    results are also written as `evaluation_<metric>_vs_iterations` (step =
    the optimizer's `iterations`). Per-task figures of the chief's monitor
    (`kfit_ps.training.monitor`: each worker's steps/s, each ps' CPU cores
    over the last window) go to `log_dir/tasks` as `<task>/<figure>` (e.g.
    `worker_1/steps_per_second`), at each epoch end and each `update_freq`
    sync. With an integer `update_freq`, the epoch's
    metrics so far are written as `batch_<metric>` every `update_freq` global
    steps, with step = `iterations`. Those values are exact: `fit` synchronises
    once per `update_freq` steps for them (never per batch), so choose a
    frequency that is large against `steps_per_execution`.

    ```python
    tb = kfit_ps.callbacks.TensorBoard("logs", update_freq=200)
    model.fit(dc, epochs=5, steps_per_epoch=1000, callbacks=[tb])
    ```

    Args:
        log_dir: directory for the event files. Defaults to `"logs"`.
        update_freq: `"epoch"` or a positive number of steps. Defaults to `"epoch"`.
    """

    def __init__(self, log_dir="logs", update_freq="epoch"):
        super().__init__()
        self.sync_every = sync_every_from("TensorBoard", "update_freq", update_freq)
        self.log_dir = validation.path(log_dir)
        self.update_freq = update_freq
        self._writers = {}

    def _writer(self, name):
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(
                checkpoint_files.join(self.log_dir, name))
        return self._writers[name]

    def _write(self, name, tag_format, logs, step):
        summaries.write_scalars(self._writer(name), tag_format, logs, step)

    def on_train_sync(self, epoch, step, logs):
        iteration = checkpoint_files.training_step(self.model)
        self._write("train", "batch_{}", logs, iteration)
        self._write_tasks(iteration)

    def _write_tasks(self, step):
        figures = {f"{task.replace(':', '_')}/{name}": value
                   for task, values in job_monitor().task_figures().items()
                   for name, value in values.items()}
        if figures:
            self._write("tasks", "{}", figures, step)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        val = {k[4:]: v for k, v in logs.items() if k.startswith("val_")}
        self._write("train", "epoch_{}", train, epoch)
        self._write_tasks(checkpoint_files.training_step(self.model))
        if val:
            self._write("validation", "epoch_{}", val, epoch)
            self._write("validation", "evaluation_{}_vs_iterations", val,
                        checkpoint_files.training_step(self.model))

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}
