#!/usr/bin/env bash
# Here, on a machine with PyPI: the wheels a lent device machine lacks to run bench/ (its
# image has Python 3.12 and no TensorFlow; nothing can be fetched there), in parts of at most
# PART_MIB under .whl/ (which git ignores), with their checksums in .whl/parts.sha256.
# Usage: bench/device/wheels.sh            (README.md beside this file: what comes next)
# WHEELS_FROM=DIR packs the wheels in DIR instead of downloading them (the tests' stand-ins).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PART_SIZE=${PART_SIZE:-56M}  # a call carries 64 MiB with the working tree (about 3 MiB)
# The versions the tests cover (pyproject.toml), the CPU build of TensorFlow (274 MB against
# 573 MB; a sweep of CPU processes), and the packages TensorFlow and Keras need that the
# device image lacks or holds at versions outside their ranges.
PACKAGES=(tensorflow-cpu==2.21.0 keras==3.15.1 namex==0.1.0 optree==0.20.0
          numpy==2.4.6 ml_dtypes==0.7.0 protobuf==7.36.2 h5py==3.14.0 flatbuffers==25.12.19
          astunparse==1.6.3 gast==0.7.0 google-pasta==0.2.0 termcolor==3.3.0)
out=.whl  # .gitignore lists it
rm -rf "$out" && mkdir -p "$out/wheels"
if [ -n "${WHEELS_FROM:-}" ]; then
    cp "$WHEELS_FROM"/*.whl "$out/wheels/"
else
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$out/wheels" "${PACKAGES[@]}"
fi
tar -C "$out" -cf - wheels | split -b "$PART_SIZE" -d -a 2 - "$out/part"
rm -r "$out/wheels"
(cd "$out" && sha256sum part?? > parts.sha256)
echo "$(ls "$out"/part?? | wc -l) parts in $out:"
ls -l "$out"/part?? | awk '{printf "  %s: %.1f MiB\n", $NF, $5 / 1048576}'
