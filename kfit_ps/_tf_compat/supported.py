"""The TensorFlow and Keras versions kfit_ps' private-API uses are tested with.

No imports: a server process reads this before it decides how to import
TensorFlow (`server_api`). Keep it in sync with pyproject.toml.
"""

# (package, lowest supported, first unsupported).
SUPPORTED = {
    "tensorflow": ((2, 21), (2, 22)),
    "keras": ((3, 15), (3, 16)),
}


def major_minor(version):
    """`"2.21.0rc1"` -> `(2, 21)`."""
    parts = version.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def is_supported(name, version):
    low, high = SUPPORTED[name]
    return low <= major_minor(version) < high
