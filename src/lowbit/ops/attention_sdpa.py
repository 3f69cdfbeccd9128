"""The bf16 fallback for prefill: torch SDPA over the cache dequantized into one scratch buffer.

    out = sdpa_attention(q, k, v, spec)          (lowbit.ops.attention.attention(..., backend="sdpa"))

Where the tuning table says lowbit's prefill kernel loses to cuDNN / flash SDPA, the cache block
being attended is dequantized (code x scale in fp32, rounded once more to bf16) into a reusable
bf16 buffer and torch's scaled_dot_product_attention runs on it. It is NOT lowbit's quantized
arithmetic: Q is not quantized and P is not quantized per block (spec.q_format / p_format /
p_block are ignored; spec.causal and sm_scale are kept). Its own float64 reference and gate:
lowbit.ops.attention_reference.sdpa_bf16_reference.

The buffer: one bf16 tensor per device, grown to the largest K + V seen and reused (views), so
repeated calls allocate nothing that persists; `scratch_bytes()` reports it. A bf16 cache is
used as it is (no copy). Causal masks are bottom-right aligned as everywhere in lowbit (key j
seen by query i when j <= i + Tk - Tq): is_causal where Tq == Tk (torch's top-left alignment is
the same there), torch's causal_lower_right bias otherwise.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from lowbit.ops import attention_reference as ar
from lowbit.ops.kernels.schemes import have_triton
from lowbit.ops.kv_quant import KVQuant

_SCRATCH: dict[torch.device, torch.Tensor] = {}
SDPA_BACKENDS = (None, "cudnn", "flash", "efficient", "math")


def scratch_bytes() -> int:
    """Bytes held by the dequantization buffers (all devices)."""
    return sum(t.numel() * t.element_size() for t in _SCRATCH.values())


def _scratch(n: int, device: torch.device) -> torch.Tensor:
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=torch.bfloat16, device=device)
        _SCRATCH[device] = buf
    return buf[:n]


def dequantize_bf16(t, out: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(decode(code) * scale)) of a KVQuant into `out` [B, H, T, D] (a bf16 tensor: as is).
    On CUDA one Triton launch (lowbit.ops.triton.kv_dequant) where it takes the layout; elsewhere
    torch ops with the same roundings."""
    if not isinstance(t, KVQuant):
        return t
    sch = t.scheme
    if t.codes.is_cuda and have_triton():
        from lowbit.ops.triton.kv_dequant import dequantize_bf16_into, supports    # optional: triton
        if supports(t) and t.codes.stride(3) == 1:
            return dequantize_bf16_into(t, out)
    if sch.format == "fp8_e4m3fn" and sch.granularity != "group":
        vals = t.codes.view(torch.float8_e4m3fn).to(torch.float32)      # exact
        out.copy_(vals.mul_(t.scale))                                   # fp32 product, then bf16 (RNE)
    elif sch.format == "int8" and sch.granularity != "group":
        out.copy_(t.codes.to(torch.float32).mul_(t.scale))
    else:
        out.copy_(t.dequantize(torch.float32))
    return out


def _backend_ctx(name: str | None):
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]
    return sdpa_kernel(be)


def sdpa_attention(q: torch.Tensor, k, v, spec: ar.AttnSpec, *, out_dtype: torch.dtype | None = None,
                   sdpa_backend: str | None = None) -> torch.Tensor:
    """q float [B, Hq, Tq, D] (used in bf16), k, v KVQuant or bf16 [B, Hkv, Tk, D]. sdpa_backend:
    None (torch's choice) or one of SDPA_BACKENDS' names, through torch.nn.attention.sdpa_kernel.
    Returns [B, Hq, Tq, D] in out_dtype (default q.dtype)."""
    if sdpa_backend not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {SDPA_BACKENDS}, got {sdpa_backend!r}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, KVQuant) and t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: the sdpa path takes a KVQuant or a bf16 cache, got {t.dtype}; cast it to bf16")
    G = ar.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    B, Hq, Tq, D = q.shape
    Tk = k.shape[2]
    if spec.causal and Tk < Tq:
        ar.allowed_mask(Tq, Tk, True)                          # raises the reference's error
    n = B * Hq // G * Tk * D
    need = sum(n for t in (k, v) if isinstance(t, KVQuant))
    buf = _scratch(need, q.device) if need else None
    parts, used = [], 0
    for t in (k, v):
        if isinstance(t, KVQuant):
            parts.append(dequantize_bf16(t, buf[used:used + n].view(B, Hq // G, Tk, D)))
            used += n
        else:
            parts.append(t)
    kb, vb = parts
    qb = q.to(torch.bfloat16)
    mask, causal = None, False
    if spec.causal and Tq == Tk:
        causal = True
    elif spec.causal and Tq > 1:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(Tq, Tk)
    with _backend_ctx(sdpa_backend):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=causal,
                                             scale=spec.scale_for(D), enable_gqa=G > 1)
    return out.to(out_dtype or q.dtype)
