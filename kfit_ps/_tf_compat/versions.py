"""Version guard for the private APIs used in `_tf_compat`."""

import keras
import tensorflow as tf

# (package, lowest supported, first unsupported): keep in sync with pyproject.toml.
SUPPORTED = {
    "tensorflow": ((2, 21), (2, 22)),
    "keras": ((3, 15), (3, 16)),
}


def _major_minor(version):
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def check_versions():
    """Raises ImportError if TensorFlow or Keras is outside the tested range."""
    found = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for name, (low, high) in SUPPORTED.items():
        version = _major_minor(found[name])
        if not low <= version < high:
            raise ImportError(
                f"kfit_ps supports {name} >={low[0]}.{low[1]},<{high[0]}.{high[1]}; found "
                f"{name} {found[name]}. Install a supported version: "
                f"pip install '{name}>={low[0]}.{low[1]},<{high[0]}.{high[1]}'."
            )
    if keras.backend.backend() != "tensorflow":
        raise ImportError(
            "kfit_ps needs the Keras TensorFlow backend; found KERAS_BACKEND="
            f"{keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before importing keras."
        )
