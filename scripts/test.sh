#!/usr/bin/env bash
# The README's test command: builds ./.venv if needed, then runs the whole suite.
# Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/conftest.py sets it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -n 2 tests "$@"
