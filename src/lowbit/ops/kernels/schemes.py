"""Scheme facts the kernel classes read in their `can_run` (one place for each predicate).

`w4a16_kind` names the 4-bit weight-only layout of a weight scheme (the W4A16 layouts, the dense
and the grouped kernels all read it); `have_triton` is whether any Triton kernel can run here.
"""
from __future__ import annotations

import functools

from lowbit.scheme import QuantScheme

PER_ROW = ("token", "channel", "tensor")


@functools.lru_cache(maxsize=None)
def have_triton() -> bool:
    """Whether Triton imports (the `gpu` extra); without it every layer runs its exact path."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def per_row_fp32(s: QuantScheme) -> bool:
    """One fp32 scale per row (token / channel) or per tensor."""
    return s.strategy in PER_ROW and s.scale_format == "fp32"


def is_mx(s: QuantScheme, fmt: str, group: int, scale_format: str, any_sign: bool = False) -> bool:
    """A block-scaled scheme: `fmt` codes in groups of `group` with `scale_format` scales."""
    return (s.format == fmt and s.strategy == "group" and s.group_size == group
            and s.scale_format == scale_format and (any_sign or s.symmetric))


def block_scaled_pair(ws: QuantScheme, xs: QuantScheme) -> str | None:
    """"fp4" (MXFP4 x MXFP4 or NVFP4 x NVFP4), "mxfp8" (MXFP8 x MXFP8) or None: the block-scaled
    pairs a dense and a grouped kernel both take."""
    if (is_mx(ws, "fp4_e2m1fn", 32, "e8m0") and is_mx(xs, "fp4_e2m1fn", 32, "e8m0")) or \
            (is_mx(ws, "fp4_e2m1fn", 16, "fp8_e4m3fn") and is_mx(xs, "fp4_e2m1fn", 16, "fp8_e4m3fn")):
        return "fp4"
    if is_mx(ws, "fp8_e4m3fn", 32, "e8m0") and is_mx(xs, "fp8_e4m3fn", 32, "e8m0"):
        return "mxfp8"
    return None


_PAIR_NAMES = {"fp4": "MXFP4 x MXFP4 or NVFP4 x NVFP4 (weights and activations)",
               "mxfp8": "MXFP8 x MXFP8 (fp8 e4m3, symmetric groups of 32, e8m0 scales)"}


def pair_refusal(ws: QuantScheme, xs: QuantScheme | None, want: str) -> str | None:
    """Why a kernel of the block-scaled pair `want` ("fp4" | "mxfp8") refuses these schemes, or None."""
    if xs is None or block_scaled_pair(ws, xs) != want:
        return f"this kernel takes {_PAIR_NAMES[want]}"
    return None


def w4a16_kind(w_scheme: QuantScheme) -> str:
    """The 4-bit weight-only kind ("int4", "uint4", "mxfp4", "nvfp4") of a weight scheme;
    NotImplementedError naming what the kernels take for any other scheme."""
    sch = w_scheme
    if sch.strategy != "group":
        raise NotImplementedError(f"W4A16: weight scheme {sch} is not per-group; the kernel takes group "
                                  "scales (int4 g32/g128, MXFP4, NVFP4)")
    g = sch.group_size
    if sch.format in ("int4", "uint4") and sch.scale_format == "fp32":
        if g < 32 or g & (g - 1):
            raise NotImplementedError(f"W4A16: int4 group_size {g} ({sch}); the kernel takes powers of "
                                      "two >= 32 (32 and 128 are the tuned ones)")
        if sch.format == "uint4" and sch.symmetric:
            raise NotImplementedError(f"W4A16: {sch}: uint4 without a zero point is not a weight scheme")
        return sch.format
    if sch.format == "fp4_e2m1fn" and sch.scale_format == "e8m0" and g == 32:
        return "mxfp4"
    if sch.format == "fp4_e2m1fn" and sch.scale_format == "fp8_e4m3fn" and g == 16:
        return "nvfp4"
    raise NotImplementedError(f"W4A16: weight scheme {sch} has no kernel; supported: int4/uint4 group "
                              "(fp32 scales), MXFP4 (group 32, e8m0), NVFP4 (group 16, fp8_e4m3fn)")


def w4a16_refusal(w_scheme: QuantScheme) -> str | None:
    """w4a16_kind's refusal as a reason (None: the scheme has a 4-bit weight-only kind)."""
    try:
        w4a16_kind(w_scheme)
    except NotImplementedError as err:
        return str(err)
    return None


def weight_only_refusal(layer) -> str | None:
    """Why a weight-only kernel (float activations) refuses a layer whose activations are quantized."""
    return None if layer.act is None else "the activations are quantized; this kernel takes float activations (weight-only)"
