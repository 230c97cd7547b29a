"""Autograph's generated-source files, for processes that end with `os._exit`.

Autograph writes the source of each function it converts to a temporary
`__autograph_generated_file*.py`, imports it under that name (kept in
`sys.modules`) and removes it in an `atexit` hook (TensorFlow 2.21,
`autograph/pyct/loader.py`). kfit_ps' commands end with `os._exit`, to skip an
interpreter teardown that would talk to stopped servers, which skips that hook
too: without this, every run left dozens of these files in the temporary
directory.
"""

import os
import sys

_PREFIX = "__autograph_generated_file"


def remove_autograph_files():
    """Removes the files autograph generated in this process; returns how many."""
    removed = 0
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith(_PREFIX) else None
        if path and os.path.basename(path).startswith(_PREFIX):
            try:
                os.remove(path)
                removed += 1
            except OSError:
                pass  # already gone
    return removed
