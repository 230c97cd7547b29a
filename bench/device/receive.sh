#!/usr/bin/env bash
# On the device machine: keeps the parts this call carried (.whl/partNN, checked against
# .whl/parts.sha256) in $KFIT_PS_DEVICE_DIR (/tmp/kfit_ps_device), and once every part of the
# manifest is there, unpacks the wheels and installs them into $KFIT_PS_DEVICE_DIR/site.
# Prints what it holds. Usage: bench/device/receive.sh     (from the repository's root)
set -euo pipefail
cd "$(dirname "$0")/../.."
state=${KFIT_PS_DEVICE_DIR:-/tmp/kfit_ps_device}
manifest=.whl/parts.sha256
if [ ! -f "$manifest" ]; then
    echo "receive.sh: no $manifest: carry .whl/parts.sha256 in every call" >&2
    exit 2
fi
if ! cmp -s "$manifest" "$state/parts.sha256"; then  # other wheels: what is held goes
    rm -rf "$state/parts" "$state/wheels" "$state/site"
fi
mkdir -p "$state/parts"
cp "$manifest" "$state/parts.sha256"
for part in .whl/part??; do
    [ -e "$part" ] || continue
    (cd .whl && sha256sum --quiet -c <(grep " $(basename "$part")\$" parts.sha256)) \
        || { echo "receive.sh: $part does not match $manifest" >&2; exit 1; }
    cp "$part" "$state/parts/"
done
wanted=$(awk '{print $2}' "$state/parts.sha256")
missing=$(for p in $wanted; do [ -e "$state/parts/$p" ] || echo "$p"; done)
if [ -n "$missing" ]; then
    echo "receive.sh: holding $(ls "$state/parts" | wc -l) of $(echo "$wanted" | wc -w)" \
         "parts; still to carry: $(echo $missing)"
    exit 0
fi
if [ ! -e "$state/site/.installed" ]; then
    rm -rf "$state/wheels" "$state/site"
    (cd "$state/parts" && sha256sum --quiet -c ../parts.sha256)
    (cd "$state/parts" && cat $wanted) | tar -C "$state" -xf -
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$state/site" "$state"/wheels/*.whl
    touch "$state/site/.installed"
fi
echo "receive.sh: every part received; the wheels are installed in $state/site"
