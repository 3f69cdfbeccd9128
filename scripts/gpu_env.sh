# Sourced by scripts/gpu_*.sh (bash): strict mode, the repository root as working directory, logs
# under $OUT (the device tool's folder; ./out elsewhere), lowbit run from source (nothing is
# installed on the device machine).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/out}"; mkdir -p "$out"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
