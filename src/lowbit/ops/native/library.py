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

ABI_VERSION = 4
NEEDS_CAPABILITY = (9, 0)   # sm_90a: Hopper (the library holds sm_90a code only)

_c = ctypes
_P, _I, _F = _c.c_void_p, _c.c_int, _c.c_float
SIGNATURES = {
    "lb_native_abi_version": [],
    "lb_w4a16": [_P] * 8 + [_I] * 11 + [_P],
    "lb_w8a16": [_P] * 7 + [_I] * 9 + [_P],
    "lb_w8a8": [_P] * 8 + [_I] * 10 + [_P],
    "lb_act_quant": [_P, _I, _I, _I, _I, _P, _P, _P],
    "lb_w4_dequant": [_P] * 4 + [_I] * 7 + [_P],
    "lb_w8_dequant": [_P] * 3 + [_I] * 5 + [_P],
}
PREFILL_ABI_VERSION = 1
PREFILL_SIGNATURES = {
    "lb_prefill_abi_version": [],
    "lb_prefill_configs": [_I],
    "lb_fp8_rowwise_gemm": [_P] * 6 + [_I] * 4 + [_P],
    "lb_fp8_blockwise_gemm": [_P] * 3 + [_I] + [_P] * 3 + [_I] * 4 + [_P],
}
TWIN_SIGNATURES = {
    "lb_twin_w4a16": [_P] * 6 + [_I] * 11,
    "lb_twin_w8a16": [_P] * 5 + [_I] * 9,
    "lb_twin_w8a8": [_P] * 6 + [_I] * 10,
    "lb_twin_act_quant": [_P, _I, _I, _I, _I, _P, _P],
    "lb_twin_w4_dequant": [_P] * 4 + [_I] * 7,
    "lb_twin_w8_dequant": [_P] * 3 + [_I] * 5,
}


def _declare(lib: ctypes.CDLL, sigs: dict) -> ctypes.CDLL:
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _I
    return lib


def _path(env: str, cached: Path | None, what: str, *finders) -> Path | str:
    """The library file to load (the file `env` names, else the cached build), or why there is none (without
    building anything), or the toolchain's root where it can be built: `finders` are build.find_* results, the
    toolchain first."""
    named = os.environ.get(env)
    if named:
        return Path(named) if Path(named).is_file() else f"{env}={named} is not a file"
    if cached is not None:
        return cached
    for found in finders:
        if isinstance(found, str):
            return f"the {what} is not built and cannot be: {found}"
    return finders[0].root  # buildable


def _library_path() -> Path | str:
    return _path("LOWBIT_NATIVE_LIB", build.cached_library(), "native library", build.find_toolchain())


def _prefill_path() -> Path | str:
    return _path("LOWBIT_PREFILL_LIB", build.cached_prefill_library(), "prefill library", build.find_toolchain(),
                 build.find_cutlass())


def gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU in this process (the native kernels are sm_90a code)"
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != NEEDS_CAPABILITY:
        return (f"the native kernels hold sm_90a (Hopper) code only; this GPU is sm_{cap[0]}{cap[1]} "
                "(the Triton kernels run there)")
    return None


def _reason(path: Path | str) -> str | None:
    return path if isinstance(path, str) else gpu_reason()


def unavailable_reason() -> str | None:
    """Why lowbit's native kernels cannot run here, or None (see the module docstring)."""
    return _reason(_library_path())


def _open(reason: str | None, path_of, build_it, sigs: dict, abi: str, version: int, what: str, rebuild: str):
    """The ctypes library of path_of() (built by build_it() where that is a toolchain root), its C ABI checked."""
    if reason is not None:
        raise RuntimeError(f"lowbit native {what} unavailable: {reason}")
    path = path_of()
    if not isinstance(path, Path) or path.is_dir():
        path = build_it(progress=lambda s: print(s, file=sys.stderr, flush=True))
    lib = _declare(ctypes.CDLL(str(path)), sigs)
    if getattr(lib, abi)() != version:
        raise RuntimeError(f"{path} has C ABI version {getattr(lib, abi)()}, this lowbit needs {version}: "
                           f"rebuild it ({rebuild})")
    return lib


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The native library (built into the cache on first use); RuntimeError with the reason where it cannot run."""
    return _open(unavailable_reason(), _library_path, build.build_library, SIGNATURES, "lb_native_abi_version",
                 ABI_VERSION, "kernels", "python -m lowbit.ops.native.build")


def prefill_unavailable_reason() -> str | None:
    """Why lowbit's native prefill GEMMs cannot run here, or None (see the module docstring)."""
    return _reason(_prefill_path())


@lru_cache(maxsize=1)
def load_prefill() -> ctypes.CDLL:
    """The prefill library (built into the cache on first use: about two minutes); RuntimeError with the reason
    where it cannot run or its C ABI is not this lowbit's."""
    return _open(prefill_unavailable_reason(), _prefill_path, build.build_prefill_library, PREFILL_SIGNATURES,
                 "lb_prefill_abi_version", PREFILL_ABI_VERSION, "prefill GEMMs",
                 "python -m lowbit.ops.native.build --prefill")


@lru_cache(maxsize=1)
def load_twin() -> ctypes.CDLL:
    """The CPU twin library (built with the host C++ compiler on first use)."""
    return _declare(ctypes.CDLL(str(build.build_twin(progress=lambda s: print(s, file=sys.stderr, flush=True)))),
                    TWIN_SIGNATURES)


def status() -> dict:
    """What `lowbit doctor` prints: the decode library file (or why none), the toolchain, the GPU check, and the
    same for the prefill library."""
    path = _library_path()
    tc = build.find_toolchain()
    pre = _prefill_path()
    return {"library": str(path) if isinstance(path, Path) and path.is_file() else None,
            "toolchain": str(tc.root) if isinstance(tc, build.Toolchain) else tc,
            "unavailable_reason": unavailable_reason(),
            "prefill_library": str(pre) if isinstance(pre, Path) and pre.is_file() else None,
            "prefill_unavailable_reason": prefill_unavailable_reason()}
