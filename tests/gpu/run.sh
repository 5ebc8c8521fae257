#!/usr/bin/env bash
# One call on a lent GPU machine (../shared/gpu/README.md): install the carried wheels, run tests/gpu and the
# CUDA cases of the worker tests, then bench/gpu.py. Logs go to $OUT (or /tmp/gpu-out); the tails are printed.
#   [TESTS_K=<pytest -k expression>] tests/gpu/run.sh [tests-timeout-s] [bench-timeout-s] [extra bench flags...]
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
TESTS_TIMEOUT=${1:-300}; BENCH_TIMEOUT=${2:-240}; shift 2 2>/dev/null || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
started=$(date +%s)
timeout "$TESTS_TIMEOUT" python3 -m pytest -q -rs -s -p no:cacheprovider --timeout 200 \
  tests/gpu tests/worker/test_decode_graphs.py "tests/worker/test_collective_groups.py" \
  tests/model/test_triton_kernels.py tests/model/test_triton_moe.py -k "${TESTS_K:-not cpu}" \
  > "$OUT/tests.log" 2>&1
echo "tests: rc=$? in $(( $(date +%s) - started )) s"
started=$(date +%s)
timeout "$BENCH_TIMEOUT" python3 bench/gpu.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
echo "bench: rc=$? in $(( $(date +%s) - started )) s"
grep -E "SWITCH|KILL9|passed|failed|Error|error" "$OUT/tests.log" | tail -n 30
tail -n 40 "$OUT/tests.log" | grep -vE "^\s*$" | tail -n 25
tail -n 30 "$OUT/bench.log"
