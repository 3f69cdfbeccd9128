"""Kernel choice: the one place that maps a (weight, activation) scheme pair to a kernel.

Four questions, each answered here and nowhere else:
- `gemm_kernel(x, w)`: which GEMM of `lowbit.ops.linear` multiplies two quantized operands
  (both QTensors; W8A8 int8 / fp8 and block-scaled fp8);
- `w4a16_kind(w)`: which 4-bit weight-only layout `lowbit.ops.weight_only` uses for a weight;
- `prepared_kind(w, x)`: which prepared fast path (`lowbit.ops.prepared`) a QuantLinear runs,
  and `exact_path(w, x)`, the exact path it runs where there is none;
- `attention_kernel(...)`: which attention kernel reads a KV cache (split-KV decode; for prefill
  the tensor-core prefill kernel, the general flash kernel or SDPA over the dequantized cache).
- `grouped_kind(w, x)`: which grouped MoE kernel (`lowbit.ops.grouped_run`) QuantExperts runs.
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

import torch

from lowbit.ops.kv_quant import KVQuant
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
    return _block_scaled_pair(ws, xs)


def _block_scaled_pair(ws: QuantScheme, xs: QuantScheme) -> str | None:
    """"fp4" (MXFP4 x MXFP4 or NVFP4 x NVFP4), "mxfp8" (MXFP8 x MXFP8) or None: the block-scaled
    pairs a dense and a grouped GEMM both take."""
    if (_mx(ws, "fp4_e2m1fn", 32, "e8m0") and _mx(xs, "fp4_e2m1fn", 32, "e8m0")) or \
            (_mx(ws, "fp4_e2m1fn", 16, "fp8_e4m3fn") and _mx(xs, "fp4_e2m1fn", 16, "fp8_e4m3fn")):
        return "fp4"
    if _mx(ws, "fp8_e4m3fn", 32, "e8m0") and _mx(xs, "fp8_e4m3fn", 32, "e8m0"):
        return "mxfp8"
    return None


GROUPED_KERNELS = ("int8", "fp8", "w8a16", "w4a16", "fp4", "mxfp8")


def grouped_kind(weight_scheme: QuantScheme, act_scheme: QuantScheme | None) -> str | None:
    """The grouped MoE kernel of an experts scheme pair (lowbit.ops.grouped_run), or None:
      int8 / fp8   int8 x int8 / fp8 e4m3 x fp8 e4m3: per-channel symmetric weights, per-row
                   (token / channel) or per-tensor symmetric activations, fp32 scales
      w8a16        int8 per-channel symmetric weights, float activations
      w4a16        int4 groups (symmetric or with zero points; w4a16_kind's group sizes), MXFP4,
                   NVFP4 weights, float activations
      fp4          MXFP4 x MXFP4, NVFP4 x NVFP4 (activations dequantized exactly into w4a16)
      mxfp8        MXFP8 x MXFP8 (e8m0 scales through the SFA / SFB words)"""
    ws, xs = weight_scheme, act_scheme
    if xs is None:
        if ws.format == "int8" and ws.strategy == "channel" and ws.symmetric and ws.scale_format == "fp32":
            return "w8a16"
        return "w4a16" if _has_w4a16(ws) and ws.format != "uint4" else None
    if (ws.strategy == "channel" and ws.symmetric and ws.scale_format == "fp32" and xs.symmetric
            and xs.strategy in _PER_ROW and xs.scale_format == "fp32"
            and ws.format == xs.format and ws.format in ("int8", "fp8_e4m3fn")):
        return "int8" if ws.format == "int8" else "fp8"
    return _block_scaled_pair(ws, xs)


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


# ---------------------------------------------------------------- attention over a (quantized) KV cache

ATTENTION_KERNELS = ("split_kv", "prefill", "flash", "sdpa")
PREFILL_CHOICES = ("prefill", "flash", "sdpa")     # what a tuning table may decide for a prefill call
SPLIT_KV_MAX_ROWS = 64          # G * Tq rows per KV head the split-KV kernel holds in one tile
_SPLIT_KV_KINDS = ("bf16", "tensor", "head", "token")


def kv_kind(t) -> str:
    """How a cache operand is stored, the fact attention kernels are chosen by: 'bf16', 'float'
    (fp32 / fp16 values), or its KV scheme's granularity ('tensor', 'head', 'token', 'group')."""
    if isinstance(t, KVQuant):
        return t.scheme.granularity
    return "bf16" if t.dtype == torch.bfloat16 else "float"


KV_APPEND_FORMATS = ("int8", "fp8_e4m3fn")      # what the one-launch decode write stores
KV_APPEND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv_append_supports(scheme) -> bool:
    """Whether lowbit.ops.triton.kv_append.append_kv writes a cache of KVScheme `scheme` (states
    in KV_APPEND_DTYPES): fp8 e4m3 / int8 codes with scales per tensor, head or token (group
    schemes and int4's packed codes go through lowbit.ops.kv_quant.quantize_kv)."""
    return scheme.format in KV_APPEND_FORMATS and scheme.granularity != "group"


def attention_kernel(Tq: int, G: int, q_exact: bool, k_kind: str, v_kind: str, choice: str | None = None,
                     prefill_reason: str | None = None) -> str:
    """The attention kernel for a call: "split_kv" (lowbit.ops.triton.attention_decode:
    flash-decoding, the keys split across programs so a decode step fills the GPU) where the rows
    of one KV head (G query heads x Tq tokens) fit its tile, Q is exact in bf16 (codes with a
    scale, or bf16) and K, V are bf16 or codes scaled per tensor / head / token. Otherwise the
    prefill choice: `choice` (a tuning table's decision, one of PREFILL_CHOICES) or, without one,
    "prefill" (lowbit.ops.triton.attention_prefill: tensor-core tiles) where that kernel runs the
    call, else "flash" (lowbit.ops.triton.attention: every cache layout). "sdpa" is torch SDPA over
    the dequantized cache (lowbit.ops.attention_sdpa: not lowbit's P-quantized arithmetic).
    prefill_reason: why the prefill kernel cannot run the call (its `unsupported`), None if it can;
    a choice of "prefill" it cannot run is refused with that reason."""
    if G * Tq <= SPLIT_KV_MAX_ROWS and q_exact and k_kind in _SPLIT_KV_KINDS and v_kind in _SPLIT_KV_KINDS:
        return "split_kv"
    if choice is None:
        return "flash" if prefill_reason else "prefill"
    if choice not in PREFILL_CHOICES:
        raise ValueError(f"attention prefill choice must be one of {PREFILL_CHOICES}, got {choice!r}")
    if choice == "prefill" and prefill_reason:
        raise ValueError(f"attention prefill choice 'prefill': {prefill_reason}; choose 'flash' or 'sdpa' "
                         "for this call")
    return choice
