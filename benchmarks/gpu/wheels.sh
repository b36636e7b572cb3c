#!/usr/bin/env bash
# Here, where pip reaches an index: the wheels a bare GPU machine needs to serve with the CUDA provider,
# laid out as loads that each fit one `run` call's carry (64 MiB with the working tree).
#
#     bash benchmarks/gpu/wheels.sh            # writes .whl/gpu/load-1 .. load-N (ignored by git)
#
# The device image has Python 3.12, torch, the CUDA 13 / cuDNN 9 libraries and the CPU onnxruntime, and
# no index. It lacks onnxruntime-gpu (about 255 MB: split into 60 MiB pieces, one per load), the exact
# grpcio / protobuf that the generated stubs need, orjson, tritonclient, and mhaserve itself. Each load
# holds SHA256SUMS for every wheel, so benchmarks/gpu/setup.sh there can check what it joined. The
# mhaserve wheel is built from this working tree: run this again after changing the code (it takes
# seconds once pip's cache holds the rest), and setup.sh installs anew when the sums differ.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.whl/gpu
PIECE=60M
PYTHON=${PYTHON:-.venv/bin/python}
# The versions pinned in pyproject.toml, and what tritonclient needs that the image lacks.
WHEELS=(
  onnxruntime-gpu==1.31.1
  grpcio==1.81.1 grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1
  protobuf==6.33.6
  prometheus-client==0.26.0
  aiohttp==3.14.5 orjson==3.13.0
  swagger-ui-bundle==1.1.0
  tritonclient==2.73.0 python-rapidjson==1.25
)

rm -rf "$OUT" && mkdir -p "$OUT/all"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$OUT/all" "${WHEELS[@]}"
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT/all" .
(cd "$OUT/all" && sha256sum -- *.whl > ../SHA256SUMS)

# The large wheel in pieces, one load each; every other wheel in the last load.
big=$(cd "$OUT/all" && ls onnxruntime_gpu-*.whl)
split -b "$PIECE" -d -a 2 "$OUT/all/$big" "$OUT/all/$big.part-"
n=0
for piece in "$OUT"/all/"$big".part-*; do
  n=$((n + 1)); mkdir -p "$OUT/load-$n"; mv "$piece" "$OUT/load-$n/"
done
# The other wheels join the last piece's load where they fit beside it, else a load of their own.
others=$(find "$OUT/all" -name '*.whl' ! -name "$big" -exec stat -c %s {} + | awk '{s += $1} END {print s + 0}')
last=$(stat -c %s "$OUT/load-$n"/*.part-*)
if [ $((last + others)) -gt $((60 * 1024 * 1024)) ]; then
  n=$((n + 1)); mkdir -p "$OUT/load-$n"
fi
find "$OUT/all" -name '*.whl' ! -name "$big" -exec mv {} "$OUT/load-$n/" \;
for load in "$OUT"/load-*; do cp "$OUT/SHA256SUMS" "$load/"; done
rm -rf "$OUT/all" "$OUT/SHA256SUMS"
du -sh "$OUT"/load-*
echo "carry one load per run call, back to back (the machine stays warm 30 s), each command starting with:"
echo "  bash benchmarks/gpu/setup.sh .whl/gpu/load-K && export PYTHONPATH=/tmp/mhaserve-gpu/site"
