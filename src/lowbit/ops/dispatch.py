"""Kernel choice by name: the registries of lowbit.ops.kernels answer, this module reads them out.

Which kernel runs a layer is decided by kernel classes asked in preference order (each says whether
it can run a layer and why not: lowbit.ops.kernels); the functions here name the answer for callers
that want a name:
- `gemm_kernel(x, w)`: which GEMM of `lowbit.ops.linear` multiplies two quantized operands
  (both QTensors; W8A8 int8 / fp8 and block-scaled fp8) -- the GEMM registry's class name;
- `grouped_kind(w, x)`: which grouped MoE kernel QuantExperts runs -- the grouped registry's kind;
- `attention_kernel(call)`: which attention kernel reads a KV cache -- the attention registry's class
  name (split-KV decode; for prefill the tensor-core prefill kernel, the general flash kernel or SDPA
  over the dequantized cache).
A pair with no kernel gets None: callers decide visibly what to do, nothing here falls back silently.
"""
from __future__ import annotations

import torch

from lowbit.ops.kernels.attention import resolve
from lowbit.ops.kernels.attention_call import AttentionCall, kv_kind  # noqa: F401  (kv_kind: for callers)
from lowbit.ops.kernels.base import LinearLayer
from lowbit.ops.kernels.gemm import GEMM
from lowbit.ops.kernels.grouped import grouped_kernel
from lowbit.ops.kernels.schemes import have_triton, w4a16_kind  # noqa: F401  (their names here, for callers)
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

def attention_kernel(call: AttentionCall, kernel: str | None = None) -> str | None:
    """Name of the attention kernel class (lowbit.ops.kernels.attention.ATTENTION) that runs `call`:
    `kernel` (the caller's choice) or a tuning table's where one decides, else the first class in
    preference order that can run it."""
    return resolve(call, kernel)[0].name


KV_APPEND_FORMATS = ("int8", "fp8_e4m3fn")      # what the one-launch decode write stores
KV_APPEND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv_append_supports(scheme) -> bool:
    """Whether lowbit.ops.triton.kv_append.append_kv writes a cache of KVScheme `scheme` (states
    in KV_APPEND_DTYPES): fp8 e4m3 / int8 codes with scales per tensor, head or token (group
    schemes and int4's packed codes go through lowbit.ops.kv_quant.quantize_kv)."""
    return scheme.format in KV_APPEND_FORMATS and scheme.granularity != "group"
