#!/usr/bin/env bash
# The one H200 run: the whole test suite on CUDA, `lowbit doctor`, then `lowbit bench`,
# logs under $OUT, a short table last. Runs from source (the device machine has torch,
# triton, pytest, hypothesis, ml_dtypes, safetensors, transformers; nothing is installed).
#   usage (on the device): bash scripts/gpu_check.sh [--quick]
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"; mkdir -p "$out"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
quick="${1:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)" | tee -a "$out/gpu.txt"
# 1. tests on CUDA (packages absent on the device -- torchao, compressed-tensors, gguf -- skip)
timeout 300 python3 -m pytest -q -x -n 4 -p no:cacheprovider tests -k "not e2e" >"$out/tests.log" 2>&1
echo "tests rc=$? :: $(tail -n 1 "$out/tests.log")" | tee "$out/summary.txt"
# 2. capability report
python3 -m lowbit.cli doctor >"$out/doctor.txt" 2>&1; echo "doctor rc=$?" | tee -a "$out/summary.txt"
# 3. benchmarks (JSON + table)
timeout 420 python3 -m lowbit.cli bench $quick --json "$out/bench.json" >"$out/bench.txt" 2>&1
echo "bench rc=$?" | tee -a "$out/summary.txt"
grep -E "FAILED|ERROR" "$out/tests.log" | head -n 20
tail -n 60 "$out/bench.txt"
cat "$out/summary.txt"
