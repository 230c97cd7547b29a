"""Version guard for the private APIs used in `_tf_compat`."""

import keras
import tensorflow as tf

from kfit_ps._tf_compat.supported import SUPPORTED, is_supported


def check_versions():
    """Raises ImportError if TensorFlow or Keras is outside the tested range."""
    found = {"tensorflow": tf.__version__, "keras": keras.__version__}
    for name, (low, high) in SUPPORTED.items():
        if not is_supported(name, found[name]):
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
