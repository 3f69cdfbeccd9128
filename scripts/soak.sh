#!/usr/bin/env bash
# Soak: every randomized test (those taking the `seed` / `rng` fixture) over N fresh seeds
# (default 50), to find assertions that hold only for lucky seeds. The summary lists each
# failing seed with the one command that reproduces it. Extra arguments go to pytest, e.g.
#   scripts/soak.sh 200 tests/algorithms/test_smoothquant.py
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
n="${1:-50}"
shift || true
[ "$#" -gt 0 ] || set -- tests
exec .venv/bin/python -m pytest -n 2 -q --soak "$n" "$@"
