#!/usr/bin/env bash
# There, on the GPU machine, once setup.sh has installed the wheels: the GPU tests, then the benchmarks, each
# output also written under OUT (the device tool's folder of files that come back).
#
#     bash benchmarks/gpu/setup.sh .whl/gpu/load-N && bash benchmarks/gpu/check.sh [SERVED_SECONDS]
#
# Everything runs from a folder outside the checkout: in the checkout's root, its mhaserve/ folder (which lacks
# server/, export/ and model/, mapped in by the installed wheel) would shadow the wheel, in the tests and in the
# server processes they start alike.
set -uo pipefail
CHECKOUT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/mhaserve-gpu/out}
SERVED=${1:-3}
export PYTHONPATH=${MHASERVE_GPU_ROOT:-/tmp/mhaserve-gpu}/site PYTHONUNBUFFERED=1
mkdir -p "$OUT" /tmp/mhaserve-gpu/run && cp -r "$CHECKOUT/tests" "$CHECKOUT/pyproject.toml" /tmp/mhaserve-gpu/run/
cd /tmp/mhaserve-gpu/run || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
bench="$CHECKOUT/benchmarks/gpu/bench_cuda.py"
python3 "$bench" --shapes 0 --steps --repeats 50 --out "$OUT/steps.json" 2>&1 | tee "$OUT/steps.log"
python3 "$bench" --repeats 30 --out "$OUT/cuda.json" 2>&1 | tee "$OUT/cuda.log"
python3 "$bench" --shapes 3 --repeats 20 --served "$SERVED" --out "$OUT/served.json" 2>&1 | tee "$OUT/served.log"
python3 "$bench" --shapes 1 --precisions fp32 --repeats 10 --served "$SERVED" --workers 1,2,4,8 --out "$OUT/workers.json" 2>&1 | tee "$OUT/workers.log"
