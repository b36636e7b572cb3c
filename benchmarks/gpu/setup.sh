#!/usr/bin/env bash
# There, on the GPU machine (no index): take one carried load of benchmarks/gpu/wheels.sh, and once every
# piece has come, join the onnxruntime-gpu wheel, check every wheel's sha256, and install them all into
# /tmp/mhaserve-gpu/site, which goes first on PYTHONPATH and so shadows the image's CPU onnxruntime.
#
#     bash benchmarks/gpu/setup.sh .whl/gpu/load-K && export PYTHONPATH=/tmp/mhaserve-gpu/site
#
# Each call keeps its pieces outside the repository (a call's working tree is replaced by the next), so
# calls back to back while the machine stays warm bring the whole set; exit 0 once installed (also when
# it already was), 3 while pieces are still missing, 1 on a checksum or install failure.
set -euo pipefail
LOAD=${1:?usage: setup.sh .whl/gpu/load-K}
ROOT=${MHASERVE_GPU_ROOT:-/tmp/mhaserve-gpu}
PYTHON=${PYTHON:-python3}
mkdir -p "$ROOT/pieces"
cp -f "$LOAD"/* "$ROOT/pieces/"
SUMS="$ROOT/pieces/SHA256SUMS"

if [ -f "$ROOT/installed" ] && cmp -s "$SUMS" "$ROOT/installed"; then
  echo "mhaserve GPU wheels: already installed in $ROOT/site"
  exit 0
fi

missing=()
mkdir -p "$ROOT/wheels"
while read -r sum wheel; do
  if [ -f "$ROOT/pieces/$wheel" ]; then
    cp -f "$ROOT/pieces/$wheel" "$ROOT/wheels/$wheel"
  elif ls "$ROOT/pieces/$wheel".part-* > /dev/null 2>&1; then
    cat "$ROOT/pieces/$wheel".part-* > "$ROOT/wheels/$wheel"  # split -d numbers the pieces in order
  else
    missing+=("$wheel")
  fi
done < "$SUMS"
if [ ${#missing[@]} -gt 0 ]; then
  echo "mhaserve GPU wheels: ${#missing[@]} still to come (carry the next load)"
  exit 3
fi

# A joined wheel with a piece still missing fails here too: its sum cannot match.
if ! (cd "$ROOT/wheels" && sha256sum --quiet -c "$SUMS"); then
  echo "mhaserve GPU wheels: checksum mismatch; carry the loads again" >&2
  rm -f "$ROOT"/wheels/*.whl
  exit 1
fi
rm -rf "$ROOT/site"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ROOT/site" "$ROOT"/wheels/*.whl
# From / : in the repository's root its mhaserve/ folder (no server/ inside) would shadow the wheel.
cd / && PYTHONPATH="$ROOT/site${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'PY'
import onnxruntime as ort

import mhaserve.server.app  # noqa: F401  (the serving path imports with these wheels)

assert "CUDAExecutionProvider" in ort.get_available_providers(), ort.get_available_providers()
print(f"onnxruntime {ort.__version__} from {ort.__file__}: providers {ort.get_available_providers()}")
PY
cp "$SUMS" "$ROOT/installed"
rm -rf "$ROOT/pieces"/*.part-* "$ROOT/wheels"
