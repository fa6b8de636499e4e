#!/usr/bin/env bash
# One run of `make test-gpu` and `make bench-gpu` on a lent GPU machine without internet, for
# sessions whose device time is short: the wheels from `make gpu-wheels` (carried as .whl/)
# installed into /tmp/site, each part under its own time limit, everything it prints and
# writes under $OUT (default ./gpu-out). Usage: tests/gpu/device_check.sh [test seconds] [bench seconds]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
python3 -m pip install --quiet --no-index --no-deps --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1
export PYTHONPATH=/tmp/site:.
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout "${1:-300}" make test-gpu GPU_PYTHON=python3 > "$out/test-gpu.log" 2>&1; echo "test-gpu exit $?" >> "$out/test-gpu.log"
timeout "${2:-420}" make bench-gpu GPU_PYTHON=python3 > "$out/bench-gpu.log" 2>&1; echo "bench-gpu exit $?" >> "$out/bench-gpu.log"
cp benchmarks/results/gpu_*.md "$out/" 2>/dev/null
tail -n 5 "$out"/*.log
