#!/usr/bin/env bash
# The quantized-model runtime on the H200, in one call: the CUDA tests of the prepared path
# and the kernels it runs, the layer benchmark (QuantLinear vs bf16 F.linear, eager and CUDA
# graph), and the end-to-end model benchmark when present. Logs under $OUT, a table last.
#   usage (on the device): bash scripts/gpu_runtime.sh [--no-tests] [--no-layers] [--no-model]
source "$(dirname "$0")/gpu_env.sh"
tests=1; layers=1; model=1
for a in "$@"; do case "$a" in --no-tests) tests=0;; --no-layers) layers=0;; --no-model) model=0;; esac; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
: > "$out/summary.txt"
if [ $tests = 1 ]; then
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n 8 -p no:cacheprovider -W ignore::DeprecationWarning \
    ${RUNTIME_TESTS:-tests/ops/test_runtime.py tests/nn/test_quant_linear.py tests/ops/test_w4a16.py tests/ops/test_fused_quant.py tests/ops/test_gemm_triton.py tests/ops/test_linear_dispatch.py} >"$out/tests.log" 2>&1
  echo "tests rc=$? ($(( $(date +%s) - t0 )) s) :: $(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -n 1)" | tee -a "$out/summary.txt"
  grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
fi
if [ $layers = 1 ]; then
  t0=$(date +%s)
  timeout "${LAYER_TIMEOUT:-200}" python3 -m lowbit.bench.layers --json "$out/bench-layers.json" ${LAYER_ARGS:-} >"$out/bench_layers.log" 2>&1
  echo "layers rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
fi
if [ $model = 1 ] && [ -f src/lowbit/bench/model.py ]; then
  t0=$(date +%s)
  timeout "${MODEL_TIMEOUT:-300}" python3 -m lowbit.entrypoints.main bench model --shape 8b --layers 4 --json "$out/bench-model.json" \
    --plot "$out/bench-model.png" ${MODEL_ARGS:-} >"$out/bench_model.log" 2>&1
  echo "model rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"
fi
[ -f "$out/bench_layers.log" ] && sed -n '/# layer table/,$p' "$out/bench_layers.log" | tail -n 140
[ -f "$out/bench_model.log" ] && tail -n 60 "$out/bench_model.log"
cat "$out/summary.txt"
