#!/usr/bin/env bash
# The README's main command: builds ./.venv if needed, then runs lowbit's main job.
# Without arguments (the main job itself) its printed output is also recorded in
# benchmarks/results/main-job.txt, the file tests/meta/test_readme.py compares the README's
# headline figures with (the job takes minutes, too long for a test to rerun).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export HF_HUB_OFFLINE=1
if [ "$#" -eq 0 ]; then
    .venv/bin/lowbit quantize | tee benchmarks/results/main-job.txt
    exit "${PIPESTATUS[0]}"
fi
exec .venv/bin/lowbit quantize "$@"
