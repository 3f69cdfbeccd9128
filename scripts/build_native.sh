#!/usr/bin/env bash
# Builds lowbit's native Hopper library here (no GPU needed) with the pip CUDA toolchain that
# scripts/setup.sh installs, and copies it to ./.native/ for a GPU run to carry:
#   bash scripts/build_native.sh      then a device call with carry [".native"] runs `scripts/gpu.sh native`
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
lib="$(PYTHONPATH=src .venv/bin/python -m lowbit.ops.native.build)"
mkdir -p .native && cp "$lib" .native/liblowbit_native.so
echo "lowbit native: .native/liblowbit_native.so ($(du -h .native/liblowbit_native.so | cut -f1)) from $lib"
