#!/bin/bash
# Under a CPU quota, threads sized by the host's cores against threads sized by the quota, side by side.
#
#   sudo flock /tmp/bench.lock bash benchmarks/cpu_quota.sh [CPUS] [HOST_THREADS] [ROUNDS]
#
# Two servers of the working tree serve the embedded default model, each in a cgroup of its own allowed CPUS CPUs
# per 100 ms (default 1): one with --intra-op-threads HOST_THREADS (default: the host's CPUs, what a server sized by
# os.cpu_count() ran), the other with its default (the cores it may use: CPUS, rounded down). `mhaserve bench`
# measures [1,16,512] and [1,128,512] at one caller and sixteen on each in turn, the order swapped every other
# round. Needs root and the cgroup cpu controller (v1 or v2). Not a test: BENCHMARKS.md records the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
CPUS=${1:-1}
HOST_THREADS=${2:-$(nproc --all)}
ROUNDS=${3:-3}
PY=.venv/bin/python
MODEL=$($PY -c "from mhaserve.export.default_model import ensure_default_model; print(ensure_default_model())")
PERIOD=100000
QUOTA=$($PY -c "print(round($CPUS * $PERIOD))")

if [ -d /sys/fs/cgroup/cpu ]; then ROOT=/sys/fs/cgroup/cpu; else ROOT=/sys/fs/cgroup; fi
groups=()
for name in host quota; do
  folder=$ROOT/mhaserve-bench-$name-$$
  mkdir "$folder"
  if [ -f "$folder/cpu.cfs_quota_us" ]; then
    echo $PERIOD > "$folder/cpu.cfs_period_us"; echo "$QUOTA" > "$folder/cpu.cfs_quota_us"
  else
    echo "$QUOTA $PERIOD" > "$folder/cpu.max"
  fi
  groups+=("$folder")
done
LOGS=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  for folder in "${groups[@]}"; do rmdir "$folder" 2>/dev/null || true; done
}
trap cleanup EXIT

serve() {  # cgroup, port, log, flags...
  local folder=$1 port=$2 log=$3; shift 3
  (echo $BASHPID > "$folder/cgroup.procs"
   exec $PY -m mhaserve.cli serve --model-dir "$MODEL" --port "$port" --http-port 0 --metrics-port 0 "$@" \
     > "$log" 2>&1) &
  pids+=($!)
}
PORTS=($($PY -c "from mhaserve.server.process import free_port; print(free_port(), free_port())"))
serve "${groups[0]}" "${PORTS[0]}" "$LOGS/host.log" --intra-op-threads "$HOST_THREADS"
serve "${groups[1]}" "${PORTS[1]}" "$LOGS/quota.log"
for port in "${PORTS[@]}"; do
  for _ in $(seq 1 240); do .venv/bin/mhaserve health --url "127.0.0.1:$port" > /dev/null 2>&1 && break; sleep 1; done
done
echo "$CPUS CPUs per 100 ms each: host-sized $(grep -o 'intra_op_threads=[0-9]*' "$LOGS/host.log"), quota-sized" \
  "$(grep -o 'intra_op_threads=[0-9]*' "$LOGS/quota.log")"
names=(host quota)
for round in $(seq 1 "$ROUNDS"); do
  for length in 16 128; do
    order=(0 1); [ $((round % 2)) = 0 ] && order=(1 0)
    for i in "${order[@]}"; do
      report=$(.venv/bin/mhaserve bench --url "127.0.0.1:${PORTS[$i]}" --concurrency 1,16 --lengths "$length" \
        --duration 4 --warmup 1 2>&1)
      figures=$(echo "$report" | awk '/^ +concurrency [0-9]+ / {printf "c%s %s/s p50 %s p99 %s errors %s  ", $2, $3, $4, $7, $10}')
      echo "round $round [1,$length,512] ${names[$i]}: $figures"
      echo "$report" | grep " answered in " | sed 's/^/    /' || true
    done
  done
done
