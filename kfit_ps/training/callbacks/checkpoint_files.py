"""How kfit_ps publishes checkpoint files, so that a reader never uses half of one.

Every file goes through `tf.io.gfile`, so `gs://`, `hdfs://`, `ram://` and
other TensorFlow file systems work as local paths do. Publication never
relies on an atomic rename (object stores have none). Instead, "data, then
marker":

1. a checkpoint file (`.keras`, `.weights.h5`) is written completely;
2. then a small *marker* is written next to it (`<file>.kfit_ps.json`) with
   the training step, epoch, batch and the file's size and SHA-256 digest.

Before a checkpoint file is overwritten (a fixed `filepath`), its marker is
removed first. A reader (the side-car evaluator, `BackupAndRestore`) takes
the bytes of a file only when they match its marker's size and digest
(`read_verified`), so it never uses a partly written file, nor labels new
weights with an old step. A marker that is missing, half written or that
describes other bytes means "not published (yet)".

A training job's directory also gets `kfit_ps_training.json` when `fit`
starts, `kfit_ps_training_done.json` (with the final step) when it ends, and
`kfit_ps_training_failed.json` (with the error) when the program failed in
`fit` (an error that no restart retries).
"""

import hashlib
import json
import os
import posixpath

import tensorflow as tf

MARKER_SUFFIX = ".kfit_ps.json"
RUNNING_FILE = "kfit_ps_training.json"
DONE_FILE = "kfit_ps_training_done.json"
FAILED_FILE = "kfit_ps_training_failed.json"
_CHUNK = 16 << 20


def join(directory, name):
    """`os.path.join` for local paths, `/` for URLs (`gs://bucket/dir`)."""
    if "://" in directory:
        return posixpath.join(directory, name)
    return os.path.join(directory, name)


def dirname(path):
    if "://" in path:
        return posixpath.dirname(path)
    return os.path.dirname(os.path.abspath(path))


def write_json(path, data):
    """Writes `data` as JSON to `path` (one small write; readers check what they read)."""
    tf.io.gfile.makedirs(dirname(path))
    with tf.io.gfile.GFile(path, "w") as f:
        f.write(json.dumps(data))


class Unreadable(ValueError):
    """A JSON file exists but does not parse (for example, written halfway)."""


def read_json(path):
    """The JSON object in `path`; None if there is no such file; `Unreadable` if corrupt."""
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            text = f.read()
    except tf.errors.NotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise Unreadable(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise Unreadable(f"{path} does not hold a JSON object")
    return data


def remove(path):
    """Removes `path` if it exists."""
    try:
        tf.io.gfile.remove(path)
    except tf.errors.NotFoundError:
        pass


def fingerprint(path):
    """(size, SHA-256 hex digest) of the file at `path`."""
    digest, size = hashlib.sha256(), 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def unpublish(checkpoint_path):
    """Removes the marker of a file about to be overwritten (call before writing it)."""
    remove(checkpoint_path + MARKER_SUFFIX)


def publish(checkpoint_path, step, epoch, batch=None, **extra):
    """Writes the marker of a completely written checkpoint file; returns the marker."""
    size, sha256 = fingerprint(checkpoint_path)
    marker = {"step": int(step), "epoch": int(epoch),
              "batch": None if batch is None else int(batch), "size": size,
              "sha256": sha256, **extra}
    write_json(checkpoint_path + MARKER_SUFFIX, marker)
    return marker


def republish(checkpoint_path, marker, **changes):
    """Rewrites the marker of a published checkpoint file with `changes` (its bytes are the
    same: size and hash kept), through a temporary file renamed over it, so a reader sees the
    old marker or the new one, never a part; returns the new marker."""
    updated = {**marker, **changes}
    final = checkpoint_path + MARKER_SUFFIX
    write_json(final + ".tmp", updated)
    tf.io.gfile.rename(final + ".tmp", final, overwrite=True)
    return updated


def read_marker(checkpoint_path):
    """The marker of `checkpoint_path`: None if missing, `Unreadable` if corrupt."""
    return read_json(checkpoint_path + MARKER_SUFFIX)


def published_marker(checkpoint_path):
    """(marker, None) when the file's marker describes its bytes; else (None, why not)."""
    try:
        marker = read_marker(checkpoint_path)
    except Unreadable as e:
        return None, f"{checkpoint_path}: {e}"
    if marker is None:
        return None, f"{checkpoint_path}: no marker (its write did not finish)"
    if fingerprint(checkpoint_path) != (marker.get("size"), marker.get("sha256")):
        return None, f"{checkpoint_path}: the file does not match its marker"
    return marker, None


def read_verified(checkpoint_path, marker):
    """The file's bytes if they are the ones `marker` describes, else None."""
    try:
        with tf.io.gfile.GFile(checkpoint_path, "rb") as f:
            data = f.read()
    except tf.errors.NotFoundError:
        return None
    if len(data) != marker.get("size") or hashlib.sha256(data).hexdigest() != marker.get(
            "sha256"):
        return None
    return data


def mark_training_started(directory):
    remove(join(directory, DONE_FILE))
    remove(join(directory, FAILED_FILE))
    write_json(join(directory, RUNNING_FILE), {"state": "running"})


def mark_training_failed(directory, error):
    write_json(join(directory, FAILED_FILE), {"error": f"{type(error).__name__}: {error}"})


def training_failed(directory):
    """The error that ended training in `directory` (its program failed), else None."""
    try:
        failed = read_json(join(directory, FAILED_FILE))
    except Unreadable:
        return None  # Being written: as far as a reader can tell, not (yet) failed.
    return None if failed is None else str(failed.get("error"))


def mark_training_done(directory, step):
    write_json(join(directory, DONE_FILE), {"step": int(step)})


def managed_by_kfit_ps(directory):
    """Whether a kfit_ps `ModelCheckpoint` has written in `directory`."""
    return (tf.io.gfile.exists(join(directory, RUNNING_FILE))
            or tf.io.gfile.exists(join(directory, DONE_FILE)))


def training_done(directory):
    """The final training step if training in `directory` has finished, else None."""
    try:
        done = read_json(join(directory, DONE_FILE))
    except Unreadable:
        return None  # Being written: not done yet, as far as a reader can tell.
    return None if done is None else done.get("step")


def training_step(model):
    """The model's optimizer step (`iterations`), or 0 without an optimizer."""
    optimizer = getattr(model, "optimizer", None)
    return 0 if optimizer is None else int(optimizer.iterations.numpy())
