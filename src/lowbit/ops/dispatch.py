"""Kernel choice by name: the registries of lowbit.ops.kernels answer, this module reads them out.

Which kernel runs a layer is decided by kernel classes asked in preference order (each says whether
it can run a layer and why not: lowbit.ops.kernels); the functions here name the answer for callers
that want a name:
- `gemm_kernel(x, w)`: which GEMM of `lowbit.ops.linear` multiplies two quantized operands
  (both QTensors; W8A8 int8 / fp8 and block-scaled fp8) -- the GEMM registry's class name;
- `grouped_kind(w, x)`: which grouped MoE kernel QuantExperts runs -- the grouped registry's kind;
- `attention_kernel(...)`: which attention kernel reads a KV cache (split-KV decode; for prefill
  the tensor-core prefill kernel, the general flash kernel or SDPA over the dequantized cache).
A pair with no kernel gets None: callers decide visibly what to do, nothing here falls back silently.
"""
from __future__ import annotations

import torch

from lowbit.ops.kernels.base import LinearLayer
from lowbit.ops.kernels.gemm import GEMM
from lowbit.ops.kernels.grouped import grouped_kernel
from lowbit.ops.kernels.schemes import have_triton, w4a16_kind  # noqa: F401  (their names here, for callers)
from lowbit.ops.kv_quant import KVQuant
from lowbit.scheme import QuantScheme

def gemm_kernel(x_scheme: QuantScheme | None, w_scheme: QuantScheme | None) -> str | None:
    """Name of the lowbit GEMM for this scheme pair (a class of lowbit.ops.kernels.GEMM), or None when
    there is none. x_scheme None means the activations are not quantized (weight-only schemes): no
    W8A8 kernel applies."""
    if x_scheme is None or w_scheme is None:
        return None
    return GEMM.choose(LinearLayer(w_scheme, x_scheme), None).name


def grouped_kind(weight_scheme: QuantScheme, act_scheme: QuantScheme | None) -> str | None:
    """The kind of the grouped MoE kernel of an experts scheme pair (lowbit.ops.kernels.grouped), or
    None where only the exact twin takes it (the scheme question: the device is not asked)."""
    kernel = grouped_kernel(weight_scheme, act_scheme)
    return None if kernel is None else kernel.kind


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
