"""The native library builds here, without a GPU, with the pip CUDA toolchain that scripts/setup.sh
installs: a syntax or template error in csrc/ fails CI, not the GPU run. The build is cached by source
hash (~/.cache/lowbit/native), so it compiles (~25 s on 2 cores) only when a source changed."""
import ctypes
import os

import pytest
import torch

from lowbit.ops.native import build, library


def _toolchain_or_skip():
    tc = build.find_toolchain()
    if isinstance(tc, str):
        if os.environ.get("CI"):
            pytest.fail(f"CI must compile the native kernels: {tc} (scripts/setup.sh installs the toolchain)")
        pytest.skip(tc)
    return tc


def test_library_compiles_for_sm90a_and_loads():
    _toolchain_or_skip()
    path = build.build_library(progress=lambda s: None)
    lib = ctypes.CDLL(str(path))          # the CUDA runtime is linked statically: loads without a driver
    assert lib.lb_native_abi_version() == library.ABI_VERSION
    for name in library.SIGNATURES:
        getattr(lib, name)


def test_unavailable_reason_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_NATIVE_LIB", str(tmp_path / "missing.so"))
    reason = library.unavailable_reason()
    assert "LOWBIT_NATIVE_LIB" in reason and "missing.so" in reason
    monkeypatch.delenv("LOWBIT_NATIVE_LIB")
    monkeypatch.setenv("LOWBIT_CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("LOWBIT_NATIVE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").touch()
    monkeypatch.setattr(build, "_candidates", lambda: [tmp_path])
    reason = library.unavailable_reason()
    assert "nvidia-nvvm" in reason and "lowbit[hopper]" in reason
    if not torch.cuda.is_available():
        monkeypatch.undo()
        assert "GPU" in library.unavailable_reason() or "not built" in library.unavailable_reason()
        with pytest.raises(RuntimeError, match="unavailable"):
            library.load.__wrapped__()
