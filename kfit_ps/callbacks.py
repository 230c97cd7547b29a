"""Callbacks that work under parameter-server `fit`.

Epoch-level Keras callbacks work as they are (`EarlyStopping`,
`ReduceLROnPlateau`, `CSVLogger`, `TerminateOnNaN`, and `ModelCheckpoint`,
`BackupAndRestore` and `TensorBoard` at epoch frequency). These act every N
steps on a synchronised, consistent state:

- `ModelCheckpoint(filepath, ..., save_freq="epoch" | N)`
- `BackupAndRestore(backup_dir, save_freq="epoch" | N, delete_checkpoint=None, fit_id=None)`
- `TensorBoard(log_dir, update_freq="epoch" | N)`

Write your own by subclassing `SyncCallback`.
"""

from kfit_ps.training.callbacks import (
    BackupAndRestore,
    ModelCheckpoint,
    SyncCallback,
    TensorBoard,
)

__all__ = ["BackupAndRestore", "ModelCheckpoint", "SyncCallback", "TensorBoard"]
