"""Callbacks for parameter-server training (public as `kfit_ps.callbacks`)."""

from kfit_ps.training.callbacks.backup_and_restore import BackupAndRestore
from kfit_ps.training.callbacks.base import SyncCallback
from kfit_ps.training.callbacks.model_checkpoint import ModelCheckpoint
from kfit_ps.training.callbacks.tensorboard import TensorBoard

__all__ = ["BackupAndRestore", "ModelCheckpoint", "SyncCallback", "TensorBoard"]
