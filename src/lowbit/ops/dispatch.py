"""Kernel choice: the one place that maps a (weight, activation) scheme pair to a kernel.

Three questions, each answered here and nowhere else:
- `gemm_kernel(x, w)`: which GEMM of `lowbit.ops.linear` multiplies two quantized operands
  (both QTensors; W8A8 int8 / fp8 and block-scaled fp8);
- `w4a16_kind(w)`: which 4-bit weight-only layout `lowbit.ops.weight_only` uses for a weight;
- `prepared_kind(w, x)`: which prepared fast path (`lowbit.ops.prepared`) a QuantLinear runs,
  and `exact_path(w, x)`, the exact path it runs where there is none.
A pair with no kernel gets None (or NotImplementedError naming the schemes): callers decide
visibly what to do, nothing here falls back silently.

GEMM table (x scheme, w scheme -> kernel):
  int8  token|channel|tensor (sym or asym)   x  int8 channel|tensor (sym)      -> "int8"
  fp8_e4m3fn token|channel|tensor (fp32)     x  fp8_e4m3fn channel|tensor      -> "fp8_rowwise"
  fp8_e4m3fn block (1,128) or group 128      x  fp8_e4m3fn block (128,128)     -> "fp8_block"
  fp8_e4m3fn group 32 e8m0 (MXFP8)           x  fp8_e4m3fn group 32 e8m0       -> "mxfp8"
"""
from __future__ import annotations

import functools

from lowbit.scheme import QuantScheme

GEMM_KERNELS = ("int8", "fp8_rowwise", "fp8_block", "mxfp8")
_PER_ROW = ("token", "channel", "tensor")


@functools.lru_cache(maxsize=None)
def have_triton() -> bool:
    """Whether Triton imports (the `gpu` extra); without it every layer runs its exact path."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _per_row_fp32(s: QuantScheme) -> bool:
    return s.strategy in _PER_ROW and s.scale_format == "fp32"


def gemm_kernel(x_scheme: QuantScheme | None, w_scheme: QuantScheme | None) -> str | None:
    """Name of the lowbit GEMM for this scheme pair, or None when there is none. x_scheme None
    means the activations are not quantized (weight-only schemes): no W8A8 kernel applies."""
    if x_scheme is None or w_scheme is None:
        return None
    xs, ws = x_scheme, w_scheme
    if xs.format == "int8" and ws.format == "int8":
        if _per_row_fp32(xs) and _per_row_fp32(ws) and ws.symmetric and ws.strategy != "token":
            return "int8"
        return None
    if xs.format != "fp8_e4m3fn" or ws.format != "fp8_e4m3fn":
        return None
    if _per_row_fp32(xs) and _per_row_fp32(ws):
        return "fp8_rowwise"
    x_1x128 = xs.scale_format == "fp32" and (
        (xs.strategy == "block" and xs.block_size == (1, 128))
        or (xs.strategy == "group" and xs.group_size == 128))
    if x_1x128 and ws.strategy == "block" and ws.block_size == (128, 128) and ws.scale_format == "fp32":
        return "fp8_block"
    if _mx(xs, "fp8_e4m3fn", 32, "e8m0", any_sign=True) and _mx(ws, "fp8_e4m3fn", 32, "e8m0", any_sign=True):
        return "mxfp8"
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


def _mx(s: QuantScheme, fmt: str, group: int, scale_format: str, any_sign: bool = False) -> bool:
    return (s.format == fmt and s.strategy == "group" and s.group_size == group
            and s.scale_format == scale_format and (any_sign or s.symmetric))


def _has_w4a16(ws: QuantScheme) -> bool:
    try:
        w4a16_kind(ws)
    except NotImplementedError:
        return False
    return True


def prepared_kind(weight_scheme: QuantScheme, act_scheme: QuantScheme | None) -> str | None:
    """The prepared fast-path kind of a QuantLinear's scheme pair ("w8a16", "w4a16", "w8a8",
    "fp4", "mxfp8"), or None (the layer runs its exact path)."""
    ws, xs = weight_scheme, act_scheme
    if xs is None:
        # int8 or fp8 e4m3 codes per channel / tensor: the W8A16 kernel converts either to the
        # activation dtype exactly (both are exact in bf16 and fp16)
        if _per_row_fp32(ws) and ws.format in ("int8", "fp8_e4m3fn") and ws.symmetric and ws.strategy != "token":
            return "w8a16"
        return "w4a16" if _has_w4a16(ws) else None
    if ws.strategy != "token" and ws.symmetric and (
            (_per_row_fp32(ws) and ws.format == "int8" and _per_row_fp32(xs) and xs.format == "int8")
            or (_per_row_fp32(ws) and ws.format == "fp8_e4m3fn" and _per_row_fp32(xs)
                and xs.format == "fp8_e4m3fn" and xs.symmetric)):
        return "w8a8"
    if (_mx(ws, "fp4_e2m1fn", 32, "e8m0") and _mx(xs, "fp4_e2m1fn", 32, "e8m0")) or \
            (_mx(ws, "fp4_e2m1fn", 16, "fp8_e4m3fn") and _mx(xs, "fp4_e2m1fn", 16, "fp8_e4m3fn")):
        return "fp4"
    if _mx(ws, "fp8_e4m3fn", 32, "e8m0") and _mx(xs, "fp8_e4m3fn", 32, "e8m0"):
        return "mxfp8"
    return None


def _int8_sym(s: QuantScheme | None, strategies: tuple[str, ...]) -> bool:
    return (s is not None and s.format == "int8" and s.symmetric and s.strategy in strategies
            and s.scale_format == "fp32")


def exact_path(weight_scheme: QuantScheme, act_scheme: QuantScheme | None) -> str:
    """The exact path of a QuantLinear without a kernel: "int8-intmm" (int8 symmetric per-token /
    tensor activations x per-channel / tensor weights: the exact integer accumulator) or
    "dequantized" (both operands dequantized by QTensor.dequantize, multiplied in float32)."""
    if _int8_sym(act_scheme, ("token", "tensor")) and _int8_sym(weight_scheme, ("channel", "tensor")):
        return "int8-intmm"
    return "dequantized"
