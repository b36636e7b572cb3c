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
# In the order of what a short lease must not miss; each part's start time in its log.
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; stamp GPU tests
  python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu.py 2>&1; stamp done; } | tee "$OUT/gpu_tests.log" | tail -5
bench="$CHECKOUT/benchmarks/gpu/bench_cuda.py"
# The output-only graph (fused attention) against eager at the mid shapes, with its profile.
{ stamp mid shapes; python3 "$bench" --only 2,3 --repeats 30 --profile --out "$OUT/cuda.json" 2>&1; } | tee "$OUT/cuda.log"
# Where the output-only graph's time goes: the served graph against its variants, in rounds.
{ stamp fused variants; python3 "$CHECKOUT/benchmarks/gpu/fused_variants.py" --repeats 40 --rounds 7 2>&1; } | tee "$OUT/fused.log"
{ stamp steps; python3 "$bench" --shapes 0 --steps --repeats 50 --out "$OUT/steps.json" 2>&1; } | tee "$OUT/steps.log"
{ stamp workers; python3 "$bench" --only 0 --precisions fp32 --repeats 10 --served "$SERVED" --workers 1,2,4,8 \
    --concurrency 16,64 --out "$OUT/workers.json" 2>&1; stamp done; } | tee "$OUT/workers.log"
# Sequences across worker processes on this host's cores: a forwarded step's cost, and steps/s by workers.
{ stamp sequences across workers; python3 "$CHECKOUT/benchmarks/bench_worker_forward.py" --device cuda \
    --workers 2,4,8 --rounds 2 --steps 100 --sequences 64 --hops 0 --duration 4 2>&1; stamp done; } \
  | tee "$OUT/worker_forward.log"
# Last: int8 served with live parity on this host's CPU, where it has 8-bit dot products (they skip, saying why,
# where it has none).
{ stamp int8 on the host CPU; grep -o -m1 -w -E 'avx512_vnni|avx_vnni|amx_int8' /proc/cpuinfo;
  python3 -m pytest -q -p no:cacheprovider -rs tests/integration/test_int8.py 2>&1; stamp done; } \
  | tee "$OUT/int8_tests.log" | tail -5
