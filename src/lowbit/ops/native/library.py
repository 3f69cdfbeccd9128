"""Loading lowbit's native libraries (ctypes) and saying why they cannot run here.

unavailable_reason() -> None where the native decode kernels can run on this process's GPU (the library
is built, or can be built on first use with the toolchain found), else the one reason they cannot, with
the fix. load() returns the ctypes library, building it into the cache on first use (progress lines
on stderr); LOWBIT_NATIVE_LIB names a prebuilt file to load instead (what a GPU run carries).
prefill_unavailable_reason() and load_prefill() do the same for the prefill GEMMs' library
(liblowbit_prefill.so, which also needs CUTLASS's headers to build; LOWBIT_PREFILL_LIB names a prebuilt one).
"""
from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache
from pathlib import Path

import torch

from . import build

ABI_VERSION = 3
NEEDS_CAPABILITY = (9, 0)   # sm_90a: Hopper (the library holds sm_90a code only)

_c = ctypes
_P, _I, _F = _c.c_void_p, _c.c_int, _c.c_float
SIGNATURES = {
    "lb_native_abi_version": [],
    "lb_w4a16": [_P] * 8 + [_I] * 11 + [_P],
    "lb_w8a16": [_P] * 7 + [_I] * 9 + [_P],
    "lb_w8a8": [_P] * 8 + [_I] * 10 + [_P],
    "lb_act_quant": [_P, _I, _I, _I, _I, _P, _P, _P],
}
PREFILL_ABI_VERSION = 1
PREFILL_SIGNATURES = {
    "lb_prefill_abi_version": [],
    "lb_prefill_config_built": [_I, _I],
    "lb_fp8_rowwise_gemm": [_P] * 6 + [_I] * 4 + [_P],
    "lb_fp8_blockwise_gemm": [_P] * 3 + [_I] + [_P] * 3 + [_I] * 4 + [_P],
}
TWIN_SIGNATURES = {
    "lb_twin_w4a16": [_P] * 6 + [_I] * 11,
    "lb_twin_w8a16": [_P] * 5 + [_I] * 9,
    "lb_twin_w8a8": [_P] * 6 + [_I] * 10,
    "lb_twin_act_quant": [_P, _I, _I, _I, _I, _P, _P],
    "lb_twin_w4_weights": [_P, _P, _I, _I, _I, _I, _P],
    "lb_twin_w8_weights": [_P, _I, _I, _P],
}


def _declare(lib: ctypes.CDLL, sigs: dict) -> ctypes.CDLL:
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _I
    return lib


def _library_path() -> Path | str:
    """The library file to load, or why there is none (without building anything)."""
    env = os.environ.get("LOWBIT_NATIVE_LIB")
    if env:
        return Path(env) if Path(env).is_file() else f"LOWBIT_NATIVE_LIB={env} is not a file"
    cached = build.cached_library()
    if cached is not None:
        return cached
    tc = build.find_toolchain()
    if isinstance(tc, str):
        return f"the native library is not built and cannot be: {tc}"
    return tc.root  # buildable


def _prefill_path() -> Path | str:
    """The prefill library file to load, or why there is none, or the toolchain root where it can be built."""
    env = os.environ.get("LOWBIT_PREFILL_LIB")
    if env:
        return Path(env) if Path(env).is_file() else f"LOWBIT_PREFILL_LIB={env} is not a file"
    cached = build.cached_prefill_library()
    if cached is not None:
        return cached
    for found in (build.find_toolchain(), build.find_cutlass()):
        if isinstance(found, str):
            return f"the prefill library is not built and cannot be: {found}"
    return build.find_toolchain().root  # buildable


def gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU in this process (the native kernels are sm_90a code)"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != NEEDS_CAPABILITY:
        return (f"the native kernels hold sm_90a (Hopper) code only; this GPU is sm_{cap[0]}{cap[1]} "
                "(the Triton kernels run there)")
    return None


def unavailable_reason() -> str | None:
    """Why lowbit's native kernels cannot run here, or None (see the module docstring)."""
    path = _library_path()
    if isinstance(path, str):
        return path
    return gpu_reason()


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The native library (built into the cache on first use); RuntimeError with the reason where it cannot run."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"lowbit native kernels unavailable: {reason}")
    path = _library_path()
    if not isinstance(path, Path) or path.is_dir():
        path = build.build_library(progress=lambda s: print(s, file=sys.stderr, flush=True))
    lib = _declare(ctypes.CDLL(str(path)), SIGNATURES)
    if lib.lb_native_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has C ABI version {lib.lb_native_abi_version()}, this lowbit needs {ABI_VERSION}: "
                           "rebuild it (python -m lowbit.ops.native.build)")
    return lib


def prefill_unavailable_reason() -> str | None:
    """Why lowbit's native prefill GEMMs cannot run here, or None (see the module docstring)."""
    path = _prefill_path()
    if isinstance(path, str):
        return path
    return gpu_reason()


@lru_cache(maxsize=1)
def load_prefill() -> ctypes.CDLL:
    """The prefill library (built into the cache on first use: minutes); RuntimeError with the reason where it
    cannot run or its C ABI is not this lowbit's."""
    reason = prefill_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"lowbit native prefill GEMMs unavailable: {reason}")
    path = _prefill_path()
    if not isinstance(path, Path) or path.is_dir():
        path = build.build_prefill_library(progress=lambda s: print(s, file=sys.stderr, flush=True))
    lib = _declare(ctypes.CDLL(str(path)), PREFILL_SIGNATURES)
    if lib.lb_prefill_abi_version() != PREFILL_ABI_VERSION:
        raise RuntimeError(f"{path} has C ABI version {lib.lb_prefill_abi_version()}, this lowbit needs "
                           f"{PREFILL_ABI_VERSION}: rebuild it (python -m lowbit.ops.native.build --prefill)")
    return lib


@lru_cache(maxsize=1)
def load_twin() -> ctypes.CDLL:
    """The CPU twin library (built with the host C++ compiler on first use)."""
    return _declare(ctypes.CDLL(str(build.build_twin(progress=lambda s: print(s, file=sys.stderr, flush=True)))),
                    TWIN_SIGNATURES)


def status() -> dict:
    """What `lowbit doctor` prints: the library file (or why none), the toolchain, the GPU check."""
    path = _library_path()
    tc = build.find_toolchain()
    return {"library": str(path) if isinstance(path, Path) and path.is_file() else None,
            "toolchain": str(tc.root) if isinstance(tc, build.Toolchain) else tc,
            "unavailable_reason": unavailable_reason()}
