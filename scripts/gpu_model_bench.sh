#!/usr/bin/env bash
# The H200 run of the end-to-end model benchmark (issue 9, item 5): `lowbit bench model` on a
# 4-layer Llama-3-8B-shaped model, bf16 vs every lowbit recipe (and torchao's configs, which
# skip where torchao is absent, as on the device machine), prefill and decode, eager and
# compiled. Runs from source; logs, JSON and PNG under $OUT (the PNG only where matplotlib
# imports; otherwise redraw it here: python -m lowbit.bench.model_report bench-model.json png).
# The JSON is rewritten after every variant, so a run stopped by the timeout keeps its rows.
#   usage (on the device): bash scripts/gpu_model_bench.sh [extra `lowbit bench model` options]
#   e.g. --quick, --recipes w8a8-int8,w4a16, --no-compile, --shape 1b
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "
import torch, triton
try:
    import transformers; tf = transformers.__version__
except ImportError: tf = None
try:
    import torchao; ao = torchao.__version__
except ImportError: ao = None
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', tf, 'torchao', ao)" | tee -a "$out/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$out/gpu.txt"
# the CPU-logic test of the benchmark (seconds), so a broken plumbing shows before the long run
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider tests/bench/test_bench_model.py >"$out/tests_model.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - t0 )) s) :: $(tail -n 1 "$out/tests_model.log")" | tee "$out/summary_model.txt"
# The run stops starting variants after TIME_LIMIT s; each gets --budget s (default 30) and one
# step may overrun it, so BENCH_TIMEOUT leaves room for the last variant.
t0=$(date +%s)
cmd=(python3 -m lowbit.entrypoints.main bench model --shape 8b --layers 4 --time-limit "${TIME_LIMIT:-420}"
     --json "$out/bench-model.json" --plot "$out/bench-model.png" "$@")
echo "${cmd[*]}" | tee "$out/bench_model_command.txt"
timeout "${BENCH_TIMEOUT:-540}" "${cmd[@]}" >"$out/bench_model.log" 2>&1
rc=$?
echo "bench rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary_model.txt"
grep -E "^(FAILED|ERROR)" "$out/tests_model.log" | head -n 10
grep -E "FAILED|Traceback|Error" "$out/bench_model.log" | head -n 20
if grep -q "^# lowbit bench model" "$out/bench_model.log"; then
  sed -n '/^# lowbit bench model/,$p' "$out/bench_model.log"
elif [ -s "$out/bench-model.json" ]; then   # stopped from outside: the table of what was measured
  echo "# lowbit bench model (stopped early; rows so far)"
  python3 -m lowbit.bench.model_report "$out/bench-model.json"
else
  tail -n 30 "$out/bench_model.log"
fi
cat "$out/summary_model.txt"
