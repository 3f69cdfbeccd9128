#!/usr/bin/env bash
# lowbit on a CUDA GPU, in parts that each fit one 10-minute device command. Runs from source
# (PYTHONPATH=src: nothing is installed on the device machine); logs and JSON under $OUT (./out
# elsewhere); a short table last.
#   bash scripts/gpu.sh PART[,PART...]
# Parts:
#   suite        the whole test suite on CUDA (PYTEST_WORKERS, default 16; TEST_TIMEOUT, default
#                420 s: a fresh machine compiles every Triton kernel first) and the tile-kernel
#                scale check (scripts/gpu_tile_diag.py; TILE_DIAG=0 skips it)
#   tests        some test files: TESTS="tests/ops/test_w4a16.py tests/ops/test_fused_quant.py"
#   doctor       `lowbit doctor`
#   gemm         `lowbit bench --only gemm` rows (GEMM_SHAPES=MxNxK,... or all; GEMM_ONLY=kernel)
#                and the skinny fp8 shape under alternative tiles (GEMM_SWEEP=0 skips it)
#   memory       python -m lowbit.bench.memory (MEMORY_ONLY=name,... narrows it)
#   layers       python -m lowbit.bench.layers: QuantLinear vs bf16 F.linear (LAYER_ARGS)
#   model        `lowbit bench model`: 32 Llama-3-8B layers (MODEL_LAYERS), bf16 vs MODEL_RECIPES in
#                MODEL_MODES (eager,compile,graphs); MODEL_TIMEOUT (default 560 s) bounds it, the
#                variants share the time; the targets table is printed last. RECIPE+native variants
#                (MODEL_RECIPES=w4a16,w4a16+native) load .native/liblowbit_native.so where the call carries
#                it (scripts/build_native.sh builds it here); without it their rows say n/a and why
#   moe          `lowbit bench model` on MOE_SHAPES (default mixtral and qwen3-30b-a3b, MOE_LAYERS=2 layers
#                each): the expert loop and grouped bf16 baselines vs MOE_RECIPES, the must targets last;
#                MOE_TIMEOUT s per shape (default 265: both fit one call), MOE_BUDGET s per recipe,
#                MOE_LOOP_BUDGET s for the loop's compiled rows (default 0: eager rows only); MOE_ARGS more
#                options (a CPU rehearsal: MOE_SHAPES=tiny-mixtral MOE_ARGS="--device cpu --no-compile --quick")
#   profile      the CUDA kernels of one quantized Linear call (scripts/gpu_profile_linear.py)
#   w4probe      the W4A16 pairs kernel's weight loads alone vs the kernel (lowbit.bench.w4_probe)
#   w4configs    the W4A16 pairs kernel under a few configurations vs bf16 (scripts/gpu_w4_configs.py)
#   audit        `lowbit audit` on the GPU (PROBE=1 adds the fp8 accumulator probe)
#   verify       `lowbit audit --attention` on the GPU, then `lowbit verify-model --device cuda` of tiny
#                random-weight checkpoints written there (scripts/tiny_checkpoint.py): dense w8a8-fp8,
#                w4a16 and w8a8-int8 with an fp8 KV cache under lowbit's attention, Qwen3-MoE w8a8-fp8 and w4a16
#   probe        the fp8 accumulator probe alone (scripts/gpu_fastaccum_probe.py; PROBE_M=1: one row)
#   mma          `lowbit probe`: this GPU's matrix-multiply accumulators from test vectors (mma-probe.json)
#   attention    python -m lowbit.bench.attention: attention over a quantized KV cache vs bf16 SDPA
#   distributed  1 vs 2 GPUs of one host: layer-by-layer calibration (scripts/gpu_distributed.sh;
#                needs 2 GPUs; DEVICE=cpu rehearses it on the CPU at tiny size)
#   tune         `lowbit tune` at the 8B shapes (TUNE_ARGS): the table lands in $OUT/tune.json, and
#                LOWBIT_TUNE_TABLE points the later parts of the same call at it
#   eager        host time of one quantized Linear call and of an eager decode step, with its CPU
#                profile; an eager prefill's GPU kernels; a compiled decode step at batch 1 / 16
#                (scripts/gpu_profile_eager.py)
#   native       the native sm_90a decode kernels (W4A16, W8A16, W8A8 at M = NATIVE_MS, default 1,16): checked,
#                then their fraction of the copy bandwidth at the Llama-3-8B shapes (scripts/gpu_native.py;
#                build here first with scripts/build_native.sh and carry .native; NATIVE_BUDGET s of timing)
#   prefill      the native CUTLASS prefill GEMMs (fp8 row-wise and block-wise, every tile configuration): checked,
#                then timed at M = PREFILL_MS (default 2048,4096) on the Llama-3-8B shapes against torch._scaled_mm
#                and lowbit's Triton fp8 GEMMs (scripts/gpu_native_prefill.py; build here first with
#                scripts/build_native.sh and carry .native; PREFILL_BUDGET s of timing)
# Wheels in ./.whl (scripts/gpu_wheels.sh fetches them here; name .whl in the call's carry) are
# installed first, so the suite's checkpoint tests run on the GPU machine too.
# The suite and model each need a call of their own; memory + gemm fit one together; moe takes a whole call.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"; mkdir -p "$out"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ $# -eq 0 ]; then sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
parts=",$1,"
known=",suite,tests,verify,doctor,gemm,memory,layers,model,moe,profile,w4probe,w4configs,audit,probe,mma,attention,distributed,tune,eager,native,prefill,"
for p in ${1//,/ }; do
  [[ $known == *,$p,* ]] || { echo "scripts/gpu.sh: unknown part '$p'; parts: ${known:1:-1}" >&2; exit 2; }
done
sum="$out/summary.txt"
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lowbit-site \
      "$root"/.whl/*.whl >/dev/null 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/lowbit-site" \
      && echo "wheels: $(ls "$root"/.whl | wc -l) from .whl installed" | tee -a "$sum"
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$sum"
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$sum"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$sum"
# the native library built here (scripts/build_native.sh) and carried in .native: every part may use it
# (the suite's native tests, tune's native cells, the model bench's +native rows, the native sweep)
if [ -f "$root/.native/liblowbit_native.so" ]; then
  export LOWBIT_NATIVE_LIB="${LOWBIT_NATIVE_LIB:-$root/.native/liblowbit_native.so}"
  echo "native library: $LOWBIT_NATIVE_LIB" | tee -a "$sum"
fi
if [ -f "$root/.native/liblowbit_prefill.so" ]; then
  export LOWBIT_PREFILL_LIB="${LOWBIT_PREFILL_LIB:-$root/.native/liblowbit_prefill.so}"
  echo "native prefill library: $LOWBIT_PREFILL_LIB" | tee -a "$sum"
fi
# (the test timeouts send SIGINT: pytest then prints its failures so far before it stops)
# a hung kernel (a deadlocked barrier) fails its test after PER_TEST_TIMEOUT s instead of eating the
# whole call, where pytest-timeout is installed
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${PER_TEST_TIMEOUT:-240}" --timeout-method thread)
# pytest's summary line, or where a run stopped by its timeout got to (its progress lines: F / E marks)
summary() {
  local line; line=$(grep -E '[0-9]+ (passed|failed)' "$1" | tail -n 1)
  [ -n "$line" ] && { echo "$line"; return; }
  echo "no summary (stopped) at $(grep -oE '\[ *[0-9]+%\]' "$1" | tail -n 1): $(grep -E '^[.sxXFE]+( |$)' "$1" | tr -cd 'FE' | wc -c) F/E marks so far"
}
# pytest workers share the cores: torch's default of one thread per core in each worker oversubscribed
# the machine 16-fold and CPU-side tests ran 10-20x their CI time (past the per-test timeout)
threads_per() { echo $(( $(nproc) / $1 > 0 ? $(nproc) / $1 : 1 )); }
if [[ $parts == *,suite,* ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(threads_per "${PYTEST_WORKERS:-16}")}
  t0=$(date +%s)
  timeout -s INT -k 30 "${TEST_TIMEOUT:-420}" python3 -m pytest -n "${PYTEST_WORKERS:-16}" -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} --junitxml "$out/tests.xml" tests \
      --ignore=tests/pipelines/test_models_e2e.py >"$out/tests.log" 2>&1
  echo "suite rc=$? ($(( $(date +%s) - t0 )) s) :: $(summary "$out/tests.log")" | tee -a "$sum"
  if [ "${TILE_DIAG:-1}" = 1 ]; then
    timeout 45 python3 scripts/gpu_tile_diag.py >>"$out/tests.log" 2>&1
    echo "tile diag rc=$? :: $(grep -c ' 0 scales differ, 0 rows' "$out/tests.log") clean cases, mismatching: $(grep 'scales differ' "$out/tests.log" | grep -vc ' 0 scales differ, 0 rows')" | tee -a "$sum"
  fi
fi
if [[ $parts == *,tests,* ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(threads_per "${PYTEST_WORKERS:-12}")}
  timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python3 -m pytest -n "${PYTEST_WORKERS:-12}" -p no:cacheprovider ${per_test[@]+"${per_test[@]}"} --junitxml "$out/tests.xml" ${TESTS:-tests} \
      >"$out/tests.log" 2>&1
  echo "tests rc=$? :: $(summary "$out/tests.log")" | tee -a "$sum"
fi
if [[ $parts == *,doctor,* ]]; then
  timeout 120 python3 -m lowbit.entrypoints.main doctor >"$out/doctor.txt" 2>&1
  echo "doctor rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,gemm,* ]]; then
  timeout "${GEMM_TIMEOUT:-100}" python3 - >"$out/gemm.log" 2>&1 <<'PY'
import json, os, sys
from lowbit.bench.gemm import run, run_shape
only = os.environ.get("GEMM_ONLY") or None  # lowbit kernels whose name contains it (baselines always run)
dump = lambda rows: json.dump(rows, open(os.path.join(os.environ["OUT"], "bench-gemm.json"), "w"),
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
# the skinny fp8 shape under the one-128-row-TMA tile and the 64-row tiles ops.triton.common.pick_config takes
from lowbit.bench.gemm import sweep
c = lambda bm, bn, bk, w, s, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s, **kw)
sweep({"fp8_row": [c(128, 32, 128, 4, 4, TMA=True), c(64, 64, 256, 4, 4), c(64, 64, 128, 4, 4), c(64, 32, 256, 4, 4)]},
      shapes=((128, 4096, 14336),))
PY
  echo "gemm rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,memory,* ]]; then
  only=(); [ -n "${MEMORY_ONLY:-}" ] && only=(--only "$MEMORY_ONLY")
  timeout "${BENCH_TIMEOUT:-230}" python3 -m lowbit.bench.memory ${only[@]+"${only[@]}"} --json "$out/bench-memory.json" \
      >"$out/bench_memory.log" 2>&1
  echo "memory rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,tune,* ]]; then
  timeout "${TUNE_TIMEOUT:-300}" python3 -m lowbit.entrypoints.main tune --out "$out/tune.json" ${TUNE_ARGS:-} \
      >"$out/tune.log" 2>&1
  echo "tune rc=$?" | tee -a "$sum"
  [ -s "$out/tune.json" ] && export LOWBIT_TUNE_TABLE="$out/tune.json"
fi
if [[ $parts == *,eager,* ]]; then
  timeout "${EAGER_TIMEOUT:-330}" python3 scripts/gpu_profile_eager.py >"$out/eager.log" 2>&1
  echo "eager rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,native,* ]]; then  # the library built here (scripts/build_native.sh), carried in .native
  timeout "${NATIVE_TIMEOUT:-540}" python3 scripts/gpu_native.py "$out/bench-native.json" >"$out/native.log" 2>&1
  echo "native rc=$? :: $(grep -E '^checks:' "$out/native.log")" | tee -a "$sum"
fi
if [[ $parts == *,prefill,* ]]; then  # the prefill library built here (scripts/build_native.sh), carried in .native
  timeout "${PREFILL_TIMEOUT:-540}" python3 scripts/gpu_native_prefill.py "$out/bench-prefill.json" >"$out/prefill.log" 2>&1
  echo "prefill rc=$? :: $(grep -E '^checks:' "$out/prefill.log")" | tee -a "$sum"
fi
if [[ $parts == *,layers,* ]]; then
  timeout "${LAYER_TIMEOUT:-200}" python3 -m lowbit.bench.layers --json "$out/bench-layers.json" ${LAYER_ARGS:-} \
      >"$out/bench_layers.log" 2>&1
  echo "layers rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,model,* ]]; then  # what a user runs; the JSON is rewritten after every variant
  # torchao rows where its wheel was brought along (pip install --no-deps WHEEL into $TORCHAO_DIR)
  [ -n "${TORCHAO_DIR:-}" ] && export PYTHONPATH="$PYTHONPATH:$TORCHAO_DIR"
  # the +native variants' library, built here and carried (without it and a toolchain, their rows say n/a)
  mt=${MODEL_TIMEOUT:-560}
  budget=(); [ -n "${MODEL_BUDGET:-}" ] && budget=(--budget "$MODEL_BUDGET")
  timeout "$mt" python3 -m lowbit.entrypoints.main bench model --shape 8b --layers "${MODEL_LAYERS:-32}" \
      --recipes "${MODEL_RECIPES:-w4a16,w8a16-int8,w8a8-int8,w8a8-fp8}" --modes "${MODEL_MODES:-eager,compile,graphs}" \
      ${budget[@]+"${budget[@]}"} --time-limit $(( mt - 60 )) ${MODEL_ARGS:-} \
      --json "$out/bench-model.json" --plot "$out/bench-model.png" >"$out/bench_model.log" 2>&1
  echo "model rc=$?" | tee -a "$sum"
  if ! grep -q "^# lowbit bench model" "$out/bench_model.log" && [ -s "$out/bench-model.json" ]; then
    python3 -m lowbit.bench.model_report "$out/bench-model.json" >>"$out/bench_model.log" 2>&1  # stopped: rows so far
  fi
fi
if [[ $parts == *,moe,* ]]; then  # one process per shape; each JSON is rewritten after every variant
  moe_t=${MOE_TIMEOUT:-265}; moe_b=${MOE_BUDGET:-40}
  for shape in ${MOE_SHAPES:-mixtral qwen3-30b-a3b}; do
    t0=$(date +%s)
    timeout "$moe_t" python3 -m lowbit.entrypoints.main bench model --shape "$shape" --layers "${MOE_LAYERS:-2}" \
        --recipes "${MOE_RECIPES:-w4a16,w8a8-int8,w8a8-fp8}" --budget "$moe_b" \
        --loop-budget "${MOE_LOOP_BUDGET:-0}" --time-limit $(( moe_t - 45 - moe_b )) \
        --json "$out/bench-moe-$shape.json" --plot "$out/bench-moe-$shape.png" ${MOE_ARGS:-} >"$out/bench_moe_$shape.log" 2>&1
    echo "moe $shape rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$sum"
    if ! grep -q "^# lowbit bench model" "$out/bench_moe_$shape.log" && [ -s "$out/bench-moe-$shape.json" ]; then
      { echo "# lowbit bench model (stopped by the timeout: the rows measured so far)"   # stopped: rows so far
        python3 -m lowbit.bench.moe_report "$out/bench-moe-$shape.json" "$out/bench-moe-$shape.png"; } \
          >>"$out/bench_moe_$shape.log" 2>&1
    fi
  done
fi
if [[ $parts == *,profile,* ]]; then  # PROFILE_RECIPES, PROFILE_M
  timeout "${PROFILE_TIMEOUT:-120}" python3 scripts/gpu_profile_linear.py >"$out/profile.log" 2>&1
  echo "profile rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,w4probe,* ]]; then
  timeout "${W4PROBE_TIMEOUT:-150}" python3 -m lowbit.bench.w4_probe "$out/w4probe.json" >"$out/w4probe.log" 2>&1
  echo "w4probe rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,w4configs,* ]]; then
  timeout "${W4CONFIGS_TIMEOUT:-300}" python3 scripts/gpu_w4_configs.py "$out/w4configs.json" >"$out/w4configs.log" 2>&1
  echo "w4configs rc=$?" | tee -a "$sum"
  grep '^==' "$out/w4configs.log" | tee -a "$sum"
fi
if [[ $parts == *,audit,* ]]; then
  timeout "${AUDIT_TIMEOUT:-120}" python3 -m lowbit.entrypoints.main audit --json "$out/audit_gpu.json" \
      --png "$out/audit_gpu.png" >"$out/audit_gpu.txt" 2>&1
  echo "audit rc=$?" | tee -a "$sum"
  # the data behind verify/accumulate.py's fp8 accumulator model (benchmarks/results/fastaccum_probe_h200.npz)
  [ "${PROBE:-0}" = 1 ] && timeout 60 python3 scripts/gpu_fastaccum_probe.py 2>&1 | tee -a "$sum"
fi
if [[ $parts == *,verify,* ]]; then
  timeout "${AUDIT_TIMEOUT:-120}" python3 -m lowbit.entrypoints.main audit --attention --json "$out/audit_attention_gpu.json" \
      --png "$out/audit_attention_gpu.png" >"$out/audit_attention_gpu.txt" 2>&1
  echo "audit --attention rc=$?" | tee -a "$sum"
  while read -r name args; do
    ck="/tmp/lowbit-ck-$name"; rm -rf "$ck"
    timeout 120 python3 scripts/tiny_checkpoint.py "$ck" $args >/dev/null 2>"$out/verify_$name.txt"
    extra=(); [[ $args == *--kv-cache* ]] && extra=(--attention fp8)
    timeout 150 python3 -m lowbit.entrypoints.main verify-model "$ck" --device cuda ${extra[@]+"${extra[@]}"} \
        >>"$out/verify_$name.txt" 2>&1
    echo "verify-model $name rc=$? :: $(grep -E '^  (dense|experts|attention) ' "$out/verify_$name.txt" | tr -s ' ' | cut -c1-60 | paste -sd';')" | tee -a "$sum"
  done <<'CK'
dense-fp8 w8a8-fp8
dense-w4a16 w4a16
kv-fp8 w8a8-int8 --kv-cache fp8-head
moe-fp8 w8a8-fp8 --moe
moe-w4a16 w4a16 --moe
CK
fi
if [[ $parts == *,probe,* ]]; then
  timeout 60 python3 scripts/gpu_fastaccum_probe.py 2>&1 | tail -n 5 | tee -a "$sum"
fi
if [[ $parts == *,mma,* ]]; then
  timeout "${MMA_TIMEOUT:-120}" python3 -m lowbit.entrypoints.main probe --json "$out/mma-probe.json" >"$out/mma.log" 2>&1
  echo "mma rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,attention,* ]]; then
  timeout "${ATTN_TIMEOUT:-540}" python3 -m lowbit.bench.attention --json "$out/bench-attention.json" ${ATTN_ARGS:-} \
      >"$out/bench_attention.log" 2>&1
  echo "attention rc=$?" | tee -a "$sum"
fi
if [[ $parts == *,distributed,* ]]; then
  timeout "${DIST_TIMEOUT:-540}" bash scripts/gpu_distributed.sh >"$out/distributed.log" 2>&1
  echo "distributed rc=$?" | tee -a "$sum"
fi
[ -f "$out/tests.log" ] && grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
[ -f "$out/gemm.log" ] && grep -E "lowbit_int8|bf16 |int_mm |lowbit_fp8_row |lowbit_mxfp8|scaled_row |sweep" "$out/gemm.log" | head -n 40
[ -f "$out/bench_memory.log" ] && sed -n '/# memory-bound kernels/,$p' "$out/bench_memory.log" | head -n 70
[ -f "$out/tune.log" ] && sed -n '/^# lowbit tune/,$p' "$out/tune.log" | head -n 90
[ -f "$out/eager.log" ] && grep -E "bf16 F.linear|M=1 wall|eager decode step" "$out/eager.log"
[ -f "$out/bench_layers.log" ] && sed -n '/# layer table/,$p' "$out/bench_layers.log" | tail -n 60
[ -f "$out/bench_model.log" ] && sed -n '/# lowbit bench model/,/^# targets/{/^# targets/!p}' "$out/bench_model.log" | head -n 40
[ -f "$out/profile.log" ] && grep -vE "Warning|warn" "$out/profile.log" | tail -n 60
[ -f "$out/w4probe.log" ] && grep -vE "Warning|warn" "$out/w4probe.log" | tail -n 20
[ -f "$out/audit_gpu.txt" ] && tail -n 30 "$out/audit_gpu.txt"
[ -f "$out/audit_attention_gpu.txt" ] && tail -n 25 "$out/audit_attention_gpu.txt"
[ -f "$out/distributed.log" ] && tail -n 30 "$out/distributed.log"
[ -f "$out/mma.log" ] && tail -n 30 "$out/mma.log"
[ -f "$out/bench_attention.log" ] && tail -n 30 "$out/bench_attention.log"
[ -f "$out/native.log" ] && sed -n '/^# native decode kernels/,$p' "$out/native.log"
[ -f "$out/prefill.log" ] && sed -n '/^# native prefill GEMMs/,$p' "$out/prefill.log"
[ -f "$out/bench_model.log" ] && sed -n '/^# targets/,$p' "$out/bench_model.log"   # the short table, last
cat "$sum"
for f in "$out"/bench_moe_*.log; do  # the short MoE tables last: rows, must targets, what did not run
  [ -f "$f" ] || continue
  echo "== $(basename "$f" .log)"
  if grep -q "^# lowbit bench model" "$f"; then sed -n '/^# lowbit bench model/,$p' "$f" | head -n 50; else tail -n 25 "$f"; fi
done
# few files come back from a device call: the logs go into one archive when there are many
if [ "$(find "$out" -maxdepth 1 -type f | wc -l)" -gt 7 ]; then
  (cd "$out" && tar czf logs.tgz --exclude=logs.tgz --exclude='*.json' --exclude='*.png' --exclude='*.npz' \
      --exclude=summary.txt -- * && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.txt' -o -name '*.md' \) \
      ! -name summary.txt -delete)
fi
