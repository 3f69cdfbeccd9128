#!/usr/bin/env bash
# One H200 call for the GEMM kernels: their tests on CUDA, `lowbit doctor`, a small launch-config
# sweep, then `lowbit bench --only gemm` (JSON + table). Logs under $OUT; a short table last.
#   usage (on the device, repository root): bash scripts/gpu_gemm.sh [--quick] [--no-tests] [--no-sweep]
source "$(dirname "$0")/gpu_env.sh"
quick=""; tests=1; sweep=1
for a in "$@"; do
  case "$a" in --quick) quick="--quick";; --no-tests) tests=0;; --no-sweep) sweep=0;; esac
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$out/gpu.txt"
if [ $tests = 1 ]; then
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_gemm_triton.py \
      tests/ops/test_linear_dispatch.py tests/entrypoints/test_doctor.py >"$out/tests.log" 2>&1
  echo "tests rc=$? :: $(tail -n 1 "$out/tests.log")" | tee "$out/summary.txt"
fi
python3 -m lowbit.entrypoints.main doctor >"$out/doctor.txt" 2>&1; echo "doctor rc=$?" | tee -a "$out/summary.txt"
if [ $sweep = 1 ]; then
  timeout 150 python3 - >"$out/sweep.txt" 2>&1 <<'PY'
import json, os
from lowbit.bench.gemm import sweep
c = lambda bm, bn, bk, w, s, **kw: dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s, **kw)
T = dict(TMA=True)
TP = dict(TMA=True, PERSISTENT=True)
big = {"int8": [c(128, 256, 128, 8, 4, **T), c(128, 256, 128, 8, 4, **TP)],
       "fp8_row": [c(256, 128, 128, 8, 3, **T), c(256, 128, 128, 8, 4, **T), c(128, 256, 128, 8, 4, **T),
                   c(256, 128, 256, 8, 2, **T)],
       "fp8_block": [c(128, 128, 128, 8, 3, **T), c(128, 128, 128, 8, 4, **T), c(128, 256, 128, 8, 3, **T)],
       "mxfp8": [c(128, 128, 128, 8, 3, **T), c(128, 256, 64, 8, 3, **T), c(128, 128, 64, 4, 4, **T)]}
rows = sweep(big, shapes=((8192, 8192, 8192),))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w"), indent=1)
PY
  echo "sweep rc=$?" | tee -a "$out/summary.txt"
fi
timeout 330 python3 -m lowbit.entrypoints.main bench --only gemm $quick --json "$out/bench-gemm.json" >"$out/bench.txt" 2>&1
echo "bench rc=$?" | tee -a "$out/summary.txt"
grep -E "FAILED|ERROR|Error" "$out/tests.log" 2>/dev/null | head -n 25
grep -E "sweep" "$out/sweep.txt" 2>/dev/null
sed -n '/# summary/,$p' "$out/bench.txt"
tail -n 5 "$out/bench.txt"
cat "$out/summary.txt"
