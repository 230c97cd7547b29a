#!/usr/bin/env bash
# On the device machine, in the call that carries the last part: receive it (receive.sh), then
# run the scaling sweep on the installed wheels and this checkout, its figures and chart into
# $OUT (the folder that comes back). Extra arguments go to bench/scaling.py.
# Usage: bench/device/sweep.sh [--steps 300 ...]         (README.md beside this file)
set -euo pipefail
cd "$(dirname "$0")/../.."
bench/device/receive.sh
state=${KFIT_PS_DEVICE_DIR:-/tmp/kfit_ps_device}
if [ ! -e "$state/site/.installed" ]; then
    echo "sweep.sh: parts are still missing (above)" >&2
    exit 3
fi
out=${OUT:-/tmp/kfit_ps_sweep}
mkdir -p "$out"
export PYTHONPATH="$state/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KERAS_BACKEND=tensorflow TF_CPP_MIN_LOG_LEVEL=2 CUDA_VISIBLE_DEVICES=""
tf_version=$(python3 -c 'import tensorflow as tf; print(tf.__version__)')
echo "$(nproc) cores, $(python3 --version), TensorFlow $tf_version"
set -o pipefail
python3 bench/scaling.py --workers 1,2,4,8 --ps 2,4 --steps 300 \
    --json "$out/scaling.json" --png "$out/scaling.png" "$@" 2>&1 | tee "$out/scaling.log"
