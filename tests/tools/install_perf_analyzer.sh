#!/usr/bin/env bash
# Install Triton's perf_analyzer into .tools/perf_analyzer/ for tests/e2e/test_perf_analyzer.py.
#
# The binary comes from the tritonclient 2.41.0 wheel (later wheels need a newer glibc than
# Debian bookworm's). It needs libb64 (Debian's libb64-0d) and libcudart.so.12 (PyPI's
# nvidia-cuda-runtime-cu12) even with no GPU. Idempotent; where it cannot install (no root for apt,
# no registry), it says why and exits 0, and the test is skipped.
set -u
cd "$(dirname "$0")/../.."
dest=.tools/perf_analyzer
[ -x "$dest/run" ] && "$dest/run" --version >/dev/null 2>&1 && { echo "perf_analyzer: already installed"; exit 0; }
py=${PYTHON:-.venv/bin/python}
warn() { echo "perf_analyzer: not installed ($1); its test will be skipped" >&2; exit 0; }

if ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
  [ "$(id -u)" = 0 ] || warn "libb64-0d is missing and installing it needs root"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d) >/dev/null 2>&1 \
    || warn "apt-get install libb64-0d failed"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --no-deps -q -d "$tmp" tritonclient==2.41.0 nvidia-cuda-runtime-cu12==12.9.79 >/dev/null 2>&1 \
  || warn "pip download of tritonclient 2.41.0 / nvidia-cuda-runtime-cu12 failed"
mkdir -p "$dest/bin" "$dest/lib"
(cd "$tmp" && unzip -o -q tritonclient-2.41.0-*.whl 'tritonclient-2.41.0.data/data/bin/perf_analyzer' \
  && unzip -o -q nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12') || warn "unzip failed"
cp "$tmp/tritonclient-2.41.0.data/data/bin/perf_analyzer" "$dest/bin/" && chmod +x "$dest/bin/perf_analyzer"
cp "$tmp/nvidia/cuda_runtime/lib/libcudart.so.12" "$dest/lib/"
cat > "$dest/run" <<'RUN'
#!/usr/bin/env bash
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/bin/perf_analyzer" "$@"
RUN
chmod +x "$dest/run"
"$dest/run" --version >/dev/null 2>&1 || warn "the binary does not run here"
echo "perf_analyzer: installed in $dest"
