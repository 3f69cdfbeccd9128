"""Element formats: names, derived properties, encode / decode.

    fmt = get_format("fp8_e4m3fn")
    fmt.max, fmt.min_normal, fmt.unit_roundoff, fmt.nan_codes
    codes = encode(x, fmt)          # torch.uint8 bit patterns (int formats: int8 / uint8 values)
    y = decode(codes, fmt)          # torch.float32

Every float format is one MinifloatSpec of the generic codec (minifloat.py); every property
below is derived by enumerating the codes through that codec's decoder, never typed in.
"""
from __future__ import annotations


import numpy as np
import torch

from . import integer, minifloat
from .integer import IntSpec
from .minifloat import MinifloatSpec
from .properties import CodeSet, Format, derive_float, derive_int

# name -> spec. The (ebits, mbits, bias, policy) tuples ARE the formats' definitions
# (OCP FP8/MX specs, ml_dtypes' fnuz biases); all numbers below them are derived.
_SPECS: dict[str, MinifloatSpec | IntSpec] = {
    "int8": IntSpec(8, True),
    "uint8": IntSpec(8, False),
    "int4": IntSpec(4, True),
    "uint4": IntSpec(4, False),
    "int2": IntSpec(2, True),
    "fp8_e4m3fn": MinifloatSpec(4, 3, 7, "fn"),
    "fp8_e4m3fnuz": MinifloatSpec(4, 3, 8, "fnuz"),
    "fp8_e5m2": MinifloatSpec(5, 2, 15, "ieee"),
    "fp8_e5m2fnuz": MinifloatSpec(5, 2, 16, "fnuz"),
    "fp6_e2m3fn": MinifloatSpec(2, 3, 1, "fn", nan=False),
    "fp6_e3m2fn": MinifloatSpec(3, 2, 3, "fn", nan=False),
    "fp4_e2m1fn": MinifloatSpec(2, 1, 1, "fn", nan=False),
    "e8m0fnu": MinifloatSpec(8, 0, 127, "e8m0"),
    "fp32": MinifloatSpec(8, 23, 127, "ieee"),
    "fp16": MinifloatSpec(5, 10, 15, "ieee"),
    "bf16": MinifloatSpec(8, 7, 127, "ieee"),
}

# torch's own dtype for a format where this torch has one (for kernels and casts).
_TORCH_DTYPES = {"fp8_e4m3fn": "float8_e4m3fn", "fp8_e4m3fnuz": "float8_e4m3fnuz",
                 "fp8_e5m2": "float8_e5m2", "fp8_e5m2fnuz": "float8_e5m2fnuz",
                 "e8m0fnu": "float8_e8m0fnu", "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


_BUILT: dict[str, Format] = {}


def _build(name: str) -> Format:
    """The Format of `name`, built once (a plain dict, not functools.lru_cache: torch.compile reads a
    dict entry, where it traces through an lru_cache-wrapped function and rebuilds the Format)."""
    f = _BUILT.get(name)
    if f is None:
        f = _BUILT[name] = _make(name)
    return f


def _make(name: str) -> Format:
    spec = _SPECS[name]
    if isinstance(spec, IntSpec):
        return derive_int(name, spec)
    return derive_float(name, spec, getattr(torch, _TORCH_DTYPES.get(name, ""), None))


def list_formats() -> list[str]:
    """Names accepted by get_format, in table order."""
    return list(_SPECS)


def get_format(name: str | Format) -> Format:
    """Format by name (see list_formats()); a Format is returned unchanged."""
    if isinstance(name, Format):
        return name
    if not isinstance(name, str) or name not in _SPECS:
        raise ValueError(f"unknown format {name!r}; choose one of: {', '.join(_SPECS)}")
    return _build(name)


def _is_ml_dtypes_float(dtype: np.dtype) -> bool:
    if dtype.kind != "V":
        return False
    import ml_dtypes  # only needed for its own array types

    try:
        ml_dtypes.finfo(dtype)
    except (ValueError, TypeError):
        return False
    return True


def _as_float64(x, arg: str = "x") -> torch.Tensor:
    """torch float64 view of x's exact values (torch tensor on its device, numpy array, or scalar)."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f":
            x = torch.from_numpy(np.ascontiguousarray(x))
        elif _is_ml_dtypes_float(x.dtype):  # bfloat16, float8_*, ...: widen exactly
            x = torch.from_numpy(x.astype(np.float32))
        else:
            raise TypeError(f"{arg}: numpy array of dtype {x.dtype} is not floating point; "
                            f"convert it with {arg}.astype(np.float64) if it holds values")
    elif isinstance(x, (float, int)) and not isinstance(x, bool):
        x = torch.tensor(float(x), dtype=torch.float64)
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor or numpy array, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{arg}: dtype {x.dtype} is not floating point; encode takes real values "
                        f"(use {arg}.to(torch.float64) if these integers are values)")
    return x.to(torch.float64)  # exact for every floating dtype torch has


def encode(x, fmt: str | Format, saturate: bool = True) -> torch.Tensor:
    """Encode real values ``x`` (torch, CPU or CUDA; numpy) in format ``fmt``.

    Float formats of <= 8 bits: torch.uint8 bit patterns, same shape and device, the exact
    input value rounded once to nearest, ties to even (e8m0: ties upward, like ml_dtypes).
    saturate=True (default): clamp to +-max (inf included), NaN kept; saturate=False: what
    ml_dtypes' astype gives (overflow -> inf / NaN by format). Note: ml_dtypes and torch cast
    float64 through float32 (double rounding); lowbit rounds float64 input once.
    Integer formats: round half to even, clamp to [qmin, qmax], torch.int8 / torch.uint8 values.
    """
    f = get_format(fmt)
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be True or False, got {saturate!r}")
    x64 = _as_float64(x)
    if f.kind == "int":
        return integer.encode(x64, f.spec, saturate)
    return minifloat.encode(x64, f.spec, saturate)


def decode(codes, fmt: str | Format) -> torch.Tensor:
    """float32 values of ``codes`` (torch or numpy) in format ``fmt``; same shape and device.

    Float formats: uint8 bit patterns below 2^bits. Integer formats: integer values in [qmin, qmax].
    """
    f = get_format(fmt)
    if isinstance(codes, np.ndarray):
        codes = torch.from_numpy(np.ascontiguousarray(codes))
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes: expected a torch.Tensor or numpy array, got {type(codes).__name__}")
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes: dtype {codes.dtype} is not an integer code dtype; "
                        f"pass the output of encode (uint8 bit patterns / int8 values)")
    if f.kind == "int":
        return integer.decode(codes, f.spec)
    if f.bits > 8:
        raise ValueError(f"decode works on uint8 codes; {f.name} has {f.bits} bits: "
                         f"use codes.view(torch.{_TORCH_DTYPES[f.name]}) instead")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: float-format codes are torch.uint8 bit patterns, got {codes.dtype}")
    if f.bits < 8 and torch.compiler.is_compiling():   # a device-side check keeps a graph whole
        torch._assert_async((codes < (1 << f.bits)).all(), f"codes: values >= 2^{f.bits}, not {f.name} bit patterns")
    elif f.bits < 8:
        bad = codes >= (1 << f.bits)
        if bool(bad.any()):
            raise ValueError(f"codes: {int(bad.sum())} value(s) >= 2^{f.bits}, not {f.name} bit "
                             "patterns (unpack packed nibbles / fp6 first)")
    return minifloat.decode(codes, f.spec)


__all__ = ["Format", "CodeSet", "get_format", "list_formats", "encode", "decode", "MinifloatSpec", "IntSpec"]
