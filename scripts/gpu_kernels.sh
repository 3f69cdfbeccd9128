#!/usr/bin/env bash
# One H200 call for the kernel work of issue 10 (about 5 minutes): the kernel tests on CUDA, the
# fused quantizer's tile-kernel diagnosis, the memory-bound rows (fused quantizer + W4A16) and a
# launch-config sweep of the skinny int8 GEMM. Logs under $OUT; a short table last.
#   usage (on the device, repository root): bash scripts/gpu_kernels.sh
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/summary.txt"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -n 12 -p no:cacheprovider tests/ops/test_fused_quant.py \
    tests/ops/test_w4a16.py >"$out/tests.log" 2>&1
echo "kernel tests rc=$? ($(( $(date +%s) - t0 )) s) :: $(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -n 1)" | tee -a "$out/summary.txt"
timeout 60 python3 scripts/gpu_tile_diag.py >"$out/tile_diag.txt" 2>&1
echo "tile diag rc=$? :: $(tail -n 1 "$out/tile_diag.txt")" | tee -a "$out/summary.txt"
timeout "${SWEEP_TIMEOUT:-60}" python3 - >"$out/sweep.txt" 2>&1 <<'PY'
import json, os
from lowbit.bench.gemm import sweep
c = lambda bm, bn, bk, w, s, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s, **kw)
T = dict(TMA=True)
skinny = {"int8": [c(128, 32, 128, 4, 4, **T), c(128, 64, 128, 4, 4, **T), c(128, 32, 256, 4, 3, **T),
                   c(128, 32, 128, 4, 6, **T), c(64, 64, 256, 4, 4), c(64, 32, 256, 4, 4), c(128, 64, 256, 8, 3, **T),
                   c(128, 128, 128, 8, 4, **T)]}
rows = sweep(skinny, shapes=((128, 4096, 14336),))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
PY
echo "sweep rc=$?" | tee -a "$out/summary.txt"
timeout "${BENCH_TIMEOUT:-150}" python3 -m lowbit.bench.memory --only norm_quant_int8,norm_quant_fp8,quant_int8,quant_fp8,quant_mxfp4,w4a16 \
    --json "$out/bench-memory.json" >"$out/bench_memory.log" 2>&1
echo "bench memory rc=$?" | tee -a "$out/summary.txt"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -n 20
grep -v " 0 scales differ, 0 rows of codes differ" "$out/tile_diag.txt" | head -n 20
grep "sweep" "$out/sweep.txt" | head -n 20
sed -n '/# memory-bound kernels/,$p' "$out/bench_memory.log" | grep -v "^copy_again" | head -n 80
cat "$out/summary.txt"
