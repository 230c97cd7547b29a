"""How kfit_ps writes checkpoint files, so that a reader never sees half of one.

A checkpoint file (`.keras`, `.weights.h5`) is written first; only then is a
small *marker* written next to it (`<file>.kfit_ps.json`: training step,
epoch, batch), atomically (temporary file + `os.replace`). A reader (the
side-car evaluator) that finds a marker knows the file is complete. When
training ends, `kfit_ps_training_done.json` is written in the directory.
"""

import json
import os
import tempfile

MARKER_SUFFIX = ".kfit_ps.json"
DONE_FILE = "kfit_ps_training_done.json"


def write_json_atomically(path, data):
    """Writes `data` as JSON to `path` so that readers see the old or the new file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_json(path):
    """The JSON object in `path`, or None if it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_marker(checkpoint_path, step, epoch, batch=None):
    write_json_atomically(checkpoint_path + MARKER_SUFFIX,
                          {"step": int(step), "epoch": int(epoch),
                           "batch": None if batch is None else int(batch)})


def read_marker(checkpoint_path):
    return read_json(checkpoint_path + MARKER_SUFFIX)


def mark_training_done(directory, step):
    write_json_atomically(os.path.join(directory, DONE_FILE), {"step": int(step)})


def clear_training_done(directory):
    try:
        os.remove(os.path.join(directory, DONE_FILE))
    except FileNotFoundError:
        pass


def training_done(directory):
    """The final training step if training in `directory` has finished, else None."""
    done = read_json(os.path.join(directory, DONE_FILE))
    return None if done is None else done.get("step")


def training_step(model):
    """The model's optimizer step (`iterations`), or 0 without an optimizer."""
    optimizer = getattr(model, "optimizer", None)
    return 0 if optimizer is None else int(optimizer.iterations.numpy())
