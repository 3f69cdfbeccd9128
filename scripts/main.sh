#!/usr/bin/env bash
# The README's main command: builds ./.venv if needed, then runs lowbit's main job.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export HF_HUB_OFFLINE=1
exec .venv/bin/lowbit quantize "$@"
