#!/usr/bin/env bash
# The closing H200 run of a session, in parts that each fit one 10-minute device command:
#   bash scripts/gpu_final.sh suite,gemm,memory     the CUDA test suite, GEMM rows, memory-bound rows
#     (GEMM_SHAPES=MxNxK,... or all, GEMM_ONLY=kernel, GEMM_SWEEP=0 and MEMORY_ONLY=name,... narrow the
#     two benchmarks)
#   bash scripts/gpu_final.sh audit,distributed     `lowbit audit` on the GPU, the 1-vs-2-GPU calibration run
#   MODEL_RECIPES=w4a16,mxfp4 bash scripts/gpu_final.sh model   the model benchmark (bf16 vs those recipes)
#   TESTS="tests/test_x.py" bash scripts/gpu_final.sh tests,memory   some test files, then the memory rows
#   bash scripts/gpu_final.sh profile   the CUDA kernels of one quantized Linear call (scripts/gpu_profile_linear.py)
#   bash scripts/gpu_final.sh w4probe   the W4A16 pairs kernel's weight loads alone vs the kernel (lowbit.bench.w4_probe)
#   bash scripts/gpu_final.sh w4configs the W4A16 pairs kernel under a few configurations vs bf16 (scripts/gpu_w4_configs.py)
# Logs and JSON under $OUT (at most 8 files come back: each part writes one or two); a short
# table last. Runs from source (PYTHONPATH=src): nothing is installed on the device.
# Timing of the closing run of 2026-12-01 (one H200, 16 CPUs): the whole suite needs more than 310 s
# on a fresh machine (cold Triton cache, 15 workers) and took 234 s with 16 workers once the cache was
# warm; the memory rows ~200 s; every GEMM row + the model benchmark ~150 s. So the suite gets its own
# call: `bash scripts/gpu_final.sh suite` (defaults below: 16 workers, 420 s), then memory, then gemm,model.
source "$(dirname "$0")/gpu_env.sh"
parts=",${1:-suite,gemm,memory},"
sum="$out/summary.txt"
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; git rev-parse --short HEAD 2>/dev/null; } | tee -a "$sum"
# a hung kernel (a deadlocked barrier, as Triton 3.6's warp-specialized code showed) fails its test after
# PER_TEST_TIMEOUT s instead of eating the whole call, where pytest-timeout is installed (the
# device image has it; CI does not need it)
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PER_TEST_TIMEOUT:-240}" --timeout-method thread)
# pytest's summary line, or where a run stopped by its timeout got to (its progress lines: F / E marks)
summary() {
  local line; line=$(grep -E '[0-9]+ (passed|failed)' "$1" | tail -n 1)
  [ -n "$line" ] && { echo "$line"; return; }
  echo "no summary (stopped) at $(grep -oE '\[ *[0-9]+%\]' "$1" | tail -n 1): $(grep -E '^[.sxXFE]+( |$)' "$1" | tr -cd 'FE' | wc -c) F/E marks so far"
}
if [[ $parts == *,suite,* ]]; then
  t0=$(date +%s)
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -n "${PYTEST_WORKERS:-16}" -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} tests \
      --ignore=tests/pipelines/test_models_e2e.py >"$out/tests.log" 2>&1
  echo "suite rc=$? ($(( $(date +%s) - t0 )) s) :: $(summary "$out/tests.log")" | tee -a "$sum"
  if [ "${TILE_DIAG:-1}" = 1 ]; then
    timeout 45 python3 scripts/gpu_tile_diag.py >>"$out/tests.log" 2>&1
    echo "tile diag rc=$? :: $(grep -c ' 0 scales differ, 0 rows' "$out/tests.log") clean cases, mismatching: $(grep 'scales differ' "$out/tests.log" | grep -vc ' 0 scales differ, 0 rows')" | tee -a "$sum"
  fi
fi
if [[ $parts == *,tests,* ]]; then  # some test files only: TESTS="tests/test_a.py tests/test_b.py"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n "${PYTEST_WORKERS:-12}" -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} ${TESTS:-tests} \
      >"$out/tests.log" 2>&1
  echo "tests rc=$? :: $(summary "$out/tests.log")" | tee -a "$sum"
fi
if [[ $parts == *,gemm,* ]]; then
  timeout "${GEMM_TIMEOUT:-100}" python3 - >"$out/gemm.log" 2>&1 <<'PY'
import json, os, sys
from lowbit.bench.gemm import run, run_shape
only = os.environ.get("GEMM_ONLY") or None  # lowbit kernels whose name contains it (baselines always run)
dump = lambda rows: json.dump(rows, open(os.path.join(os.environ["OUT"], "bench-gemm-final.json"), "w"),
                              indent=1, default=str)
if os.environ.get("GEMM_SHAPES") == "all":  # the bench's own shapes (lowbit bench --only gemm)
    dump(run(only))
else:
    rows = []
    for M, N, K in [tuple(map(int, s.split("x"))) for s in os.environ.get("GEMM_SHAPES", "128x4096x14336").split(",")]:
        print(f"shape M={M} N={N} K={K}", flush=True)
        rows += run_shape(M, N, K, only)
        dump(rows)
if os.environ.get("GEMM_SWEEP", "1") != "1":
    sys.exit(0)
# the skinny fp8 shape under the int8 winner's tiles (64 rows, BLOCK_K 256) and the current default
from lowbit.bench.gemm import sweep
c = lambda bm, bn, bk, w, s, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s, **kw)
sweep({"fp8_row": [c(128, 32, 128, 4, 4, TMA=True), c(64, 64, 256, 4, 4), c(64, 64, 128, 4, 4), c(64, 32, 256, 4, 4)]},
      shapes=((128, 4096, 14336),))
PY
  echo "gemm rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,memory,* ]]; then
  timeout "${BENCH_TIMEOUT:-160}" python3 -m lowbit.bench.memory \
      --only "${MEMORY_ONLY:-norm_quant_int8,norm_quant_fp8,norm_quant_mxfp4,norm_quant_nvfp4,quant_int8,quant_fp8,quant_mxfp8,quant_mxfp4,quant_nvfp4,w4a16}" \
      --json "$out/bench-memory-final.json" >"$out/bench_memory.log" 2>&1
  echo "memory rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,model,* ]]; then  # what a user runs: 4 Llama-3-8B layers, bf16 against MODEL_RECIPES
  timeout "${MODEL_TIMEOUT:-200}" python3 -m lowbit.entrypoints.main bench model --shape 8b --layers 4 \
      --recipes "${MODEL_RECIPES:-w4a16,mxfp4,nvfp4}" --budget "${MODEL_BUDGET:-15}" --time-limit $(( ${MODEL_TIMEOUT:-200} - 40 )) \
      --json "$out/bench-model-final.json" --plot "$out/bench-model-final.png" >"$out/bench_model.log" 2>&1
  echo "model rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,profile,* ]]; then  # the kernels of one quantized Linear call (PROFILE_RECIPES, PROFILE_M)
  timeout "${PROFILE_TIMEOUT:-120}" python3 scripts/gpu_profile_linear.py >"$out/profile.log" 2>&1
  echo "profile rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,w4probe,* ]]; then  # the W4A16 pairs kernel's weight loads alone (lowbit/bench/w4_probe.py)
  timeout "${W4PROBE_TIMEOUT:-150}" python3 -m lowbit.bench.w4_probe "$out/w4probe.json" >"$out/w4probe.log" 2>&1
  echo "w4probe rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,w4configs,* ]]; then
  timeout "${W4CONFIGS_TIMEOUT:-300}" python3 scripts/gpu_w4_configs.py "$out/w4configs.json" >"$out/w4configs.log" 2>&1
  echo "w4configs rc=$?" | tee -a "$sum"
  grep '^==' "$out/w4configs.log" | tee -a "$sum"
fi
if [[ $parts == *,audit,* ]]; then
  timeout "${AUDIT_TIMEOUT:-120}" python3 -m lowbit.entrypoints.main audit --json "$out/audit_h200.json" \
      --png "$out/audit_h200.png" >"$out/audit_h200.txt" 2>&1
  echo "audit rc=$?" | tee -a "$sum"
  # the accumulator probe (data for verify/accumulate.py's fp8 model; docs/fastaccum_probe_h200.npz)
  [ "${PROBE:-0}" = 1 ] && timeout 60 python3 scripts/gpu_fastaccum_probe.py 2>&1 | tee -a "$sum"
fi
if [[ $parts == *,probe,* ]]; then  # the fp8 accumulator probe alone (PROBE_M rows: 1 = cuBLAS's one-row path)
  timeout 60 python3 scripts/gpu_fastaccum_probe.py 2>&1 | tail -n 5 | tee -a "$sum"
fi
if [[ $parts == *,distributed,* ]]; then
  if [ -f scripts/gpu_distributed.sh ]; then
    timeout "${DIST_TIMEOUT:-420}" bash scripts/gpu_distributed.sh >"$out/distributed.log" 2>&1
    echo "distributed rc=$?" | tee -a "$sum"
  else
    echo "distributed: scripts/gpu_distributed.sh absent" | tee -a "$sum"
  fi
fi
[ -f "$out/tests.log" ] && grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
[ -f "$out/gemm.log" ] && grep -E "lowbit_int8|bf16 |int_mm |lowbit_fp8_row |lowbit_mxfp8|scaled_row |sweep" "$out/gemm.log" | head -n 40
[ -f "$out/bench_memory.log" ] && sed -n '/# memory-bound kernels/,$p' "$out/bench_memory.log" | grep -E "norm_quant|quant_|g128 |gemv8 |pairs|g32|mxfp4|nvfp4" | head -n 60
[ -f "$out/bench_model.log" ] && sed -n '/# lowbit bench model/,$p' "$out/bench_model.log" | head -n 30
[ -f "$out/profile.log" ] && grep -vE "Warning|warn" "$out/profile.log" | tail -n 60
[ -f "$out/w4probe.log" ] && grep -vE "Warning|warn" "$out/w4probe.log" | tail -n 20
[ -f "$out/audit_h200.txt" ] && tail -n 30 "$out/audit_h200.txt"
[ -f "$out/distributed.log" ] && tail -n 30 "$out/distributed.log"
cat "$sum"
# only 8 files come back from a device call: logs go into one archive when there are more
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 7 ]; then
  (cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude='*.json' --exclude='*.png' --exclude='*.npz' \
      --exclude=summary.txt -- * && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.txt' -o -name '*.md' \) \
      ! -name summary.txt -delete)
fi
