#!/usr/bin/env bash
# The one H200 run for the whole project: the memory-bound benchmark (full), then the test
# suite on CUDA and `lowbit doctor`, logs under $OUT, a short table last. Runs from source:
# the device machine has torch, triton, pytest, hypothesis, ml_dtypes, safetensors and
# transformers; torchao, compressed-tensors, gguf and the embedded model are absent there, so
# the tests that need them skip and the embedded-model end-to-end tests are left out. The GEMM benchmark has its own script (scripts/gpu_gemm.sh).
#   usage (on the device): bash scripts/gpu_check.sh
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$out/gpu.txt"
t0=$(date +%s)
timeout "${BENCH_TIMEOUT:-230}" python3 -m lowbit.bench.memory --json "$out/bench-memory.json" >"$out/bench_memory.log" 2>&1
echo "bench memory rc=$? ($(( $(date +%s) - t0 )) s)" | tee "$out/summary.txt"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-220}" python3 -m pytest -n 12 -p no:cacheprovider tests --ignore=tests/pipelines/test_models_e2e.py >"$out/tests.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - t0 )) s) :: $(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -n 1)" | tee -a "$out/summary.txt"
python3 -m lowbit.entrypoints.main doctor >"$out/doctor.txt" 2>&1; echo "doctor rc=$?" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 25
sed -n '/# memory-bound kernels/,$p' "$out/bench_memory.log" | tail -n 70
cat "$out/summary.txt"
