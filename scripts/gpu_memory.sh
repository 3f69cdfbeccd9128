#!/usr/bin/env bash
# The H200 run for the memory-bound kernels (issue 5): their GPU tests, then the benchmark
# (python -m lowbit.bench.memory), logs and JSON under $OUT, the short table last.
# Runs from source on the device machine (torch, triton, pytest, pytest-xdist, ml_dtypes are
# there; torchao is not, so its oracle test skips).   usage: bash scripts/gpu_memory.sh [--quick]
source "$(dirname "$0")/gpu_env.sh"
quick="${1:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$out/gpu.txt"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_fused_quant.py tests/ops/test_w4a16.py \
    tests/ops/test_sparse_linear.py >"$out/tests_memory.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - t0 )) s) :: $(tail -n 1 "$out/tests_memory.log")" | tee "$out/summary_memory.txt"
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-200}" python3 -m lowbit.bench.memory $quick --json "$out/bench-memory.json" >"$out/bench_memory.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary_memory.txt"
grep -E "^(FAILED|ERROR)" "$out/tests_memory.log" | head -n 20
grep -E "Error|error" "$out/bench_memory.log" | grep -v "^ *lowbit\|unsupported" | head -n 10
sed -n '/# memory-bound kernels/,$p' "$out/bench_memory.log"
cat "$out/summary_memory.txt"
