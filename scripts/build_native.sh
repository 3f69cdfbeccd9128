#!/usr/bin/env bash
# Builds lowbit's native Hopper libraries here (no GPU needed) with the pip CUDA toolchain and CUTLASS headers
# that scripts/setup.sh installs, and copies them to ./.native/ for a GPU run to carry:
#   bash scripts/build_native.sh      then a device call with carry [".native"] runs `scripts/gpu.sh native`
#                                     (or `prefill`)
# The decode library takes under a minute; the prefill GEMMs (CUTLASS) several minutes (PREFILL=0 skips them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
mkdir -p .native
copy() {  # copy BUILT_PATH NAME
  cp "$1" ".native/$2"
  echo "lowbit native: .native/$2 ($(du -h ".native/$2" | cut -f1)) from $1"
}
copy "$(PYTHONPATH=src .venv/bin/python -m lowbit.ops.native.build)" liblowbit_native.so
if [ "${PREFILL:-1}" != 0 ]; then
  copy "$(PYTHONPATH=src .venv/bin/python -m lowbit.ops.native.build --prefill)" liblowbit_prefill.so
fi
