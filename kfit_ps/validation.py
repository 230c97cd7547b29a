"""Argument checks shared by every layer, with errors that name the argument.

Each check returns the normalised value or raises `ValueError` in three parts:
what was received, what is expected, and (where useful) how to fix it.
"""

import os

import numpy as np


def check_int(name, value, minimum, *, owner=None, hint=None):
    """`int(value)` if `value` is an integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        prefix = f"{owner}: " if owner else ""
        suffix = f" {hint}" if hint else ""
        raise ValueError(f"{prefix}`{name}` must be {expected}. Received: {name}={value!r}."
                         f"{suffix}")
    return int(value)


def check_optional_int(name, value, minimum, *, owner=None, hint=None):
    """Like `check_int`, but None passes through."""
    return None if value is None else check_int(name, value, minimum, owner=owner, hint=hint)


def path(value):
    """A path argument as a string (`str`, `pathlib.Path`, or a URL such as `gs://b/d`)."""
    return os.fspath(value)
