"""Quantized attention over a quantized KV cache: the exact torch path and the dispatch.

    out = lowbit.ops.attention.attention(q, k, v, spec, backend="auto")

q: float [B, Hq, Tq, D]; k, v: lowbit.ops.kv_quant.KVQuant [B, Hkv, Tk, D] (the cache as stored)
or float tensors (an unquantized cache). GQA: query head h reads KV head h // (Hq // Hkv).
The arithmetic is lowbit.ops.attention_reference's (its module docstring); the torch path does it
in float32 block by block, as the Triton kernel does, and is what runs on the CPU.

Behaviour at the edges: any head_dim and length (no tile multiple needed: the kernel masks);
NaN/Inf in q is refused here and in k / v when they are written to the cache (kv_quant); an
all-zero KV head has scale 1.0 and zero codes, so its scores are 0 and its output the mean of V.
"""
from __future__ import annotations

import math

import torch

from lowbit.formats import decode, encode
from lowbit.ops import attention_reference as ar
from lowbit.ops.kernels import attention as attention_kernels
from lowbit.ops.kernels.attention_call import AttentionCall, CacheOperand, kind_key
from lowbit.ops.attention_sdpa import sdpa_attention
from lowbit.ops.kv_quant import KVQuant

BACKENDS = ("auto", "torch", "triton", "sdpa", "reference")
_LAST = {"path": None}


def last_path() -> str | None:
    """The path the last `attention` / `attention_triton` call took on this process: "split_kv",
    "prefill[<config>]", "flash", "sdpa", "torch" or "reference" (what the bench and `lowbit
    doctor` print; recorded on the host when the call is issued, so a CUDA-graph replay does not
    update it)."""
    return _LAST["path"]


def _as_kv(t, name: str):
    if isinstance(t, KVQuant):
        return t
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim == 4:
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} holds NaN/Inf; attention over them is undefined: fix the activations")
        return t
    raise TypeError(f"{name} must be a KVQuant (a quantized cache) or a float [B, H, T, D] tensor, "
                    f"got {type(t).__name__}")


def _deq_block(t, sl: slice) -> torch.Tensor:
    if isinstance(t, KVQuant):
        return t.select_tokens(sl).dequantize(torch.float32)
    return t[:, :, sl].to(torch.float32)


def _shape(t) -> tuple[int, ...]:
    return t.shape if isinstance(t, KVQuant) else tuple(t.shape)


def attention_torch(q_hat: torch.Tensor, k, v, spec: ar.AttnSpec) -> torch.Tensor:
    """float32 [B, Hq, Tq, D] output from Q_hat (float32, already quantized) and the cache."""
    G = ar.check_shapes(q_hat.shape, _shape(k), _shape(v))
    B, Hq, Tq, D = q_hat.shape
    Tk = _shape(k)[2]
    allowed = ar.allowed_mask(Tq, Tk, spec.causal, q_hat.device)
    c = torch.tensor(spec.scale_for(D) * ar.LOG2E, dtype=torch.float32)
    fmax = spec.p_max
    ninf = torch.tensor(-math.inf, dtype=torch.float32, device=q_hat.device)
    acc = torch.zeros(B, Hq, Tq, D, dtype=torch.float32, device=q_hat.device)
    l = torch.zeros(B, Hq, Tq, 1, dtype=torch.float32, device=q_hat.device)
    m = torch.full((B, Hq, Tq, 1), -math.inf, dtype=torch.float32, device=q_hat.device)
    q32 = q_hat.to(torch.float32)
    for start in range(0, Tk, spec.p_block):
        sl = slice(start, min(start + spec.p_block, Tk))
        if spec.causal and start > (Tq - 1) + (Tk - Tq):
            break                                     # no query sees these keys
        kb = _deq_block(k, sl).repeat_interleave(G, dim=1)
        vb = _deq_block(v, sl).repeat_interleave(G, dim=1)
        ab = allowed[:, sl]
        t = torch.where(ab, (q32 @ kb.transpose(-1, -2)) * c, ninf)
        mb = t.amax(dim=-1, keepdim=True)
        ok = torch.isfinite(mb)
        mb0 = torch.where(ok, mb, torch.zeros_like(mb))
        mnew = torch.maximum(m, mb)
        x = torch.where(ab & ok, torch.exp2(t - mb0), torch.zeros_like(t))
        codes = _grid32(x * fmax, spec.p_format)
        f = torch.where(ok, torch.exp2(mb0 - torch.where(torch.isfinite(mnew), mnew, mb0)) / fmax,
                        torch.zeros_like(mb))
        p = codes * f
        alpha = torch.where(torch.isfinite(m), torch.exp2(m - mnew), torch.zeros_like(m))
        acc = acc * alpha + p @ vb
        l = l * alpha + p.sum(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(mnew), mnew, m)
    return acc / l


def _grid32(v: torch.Tensor, p_format: str | None) -> torch.Tensor:
    """P codes' values (float32) from fp32 v >= 0: the same rounding as grid_round, on fp32 input."""
    if p_format is None:
        return v
    if p_format == "int8":
        return torch.round(v).clamp(0, 127)
    return decode(encode(v, p_format, saturate=True), p_format)


def attention_triton(q: torch.Tensor, k, v, spec: ar.AttnSpec, *, q_scale: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, kernel: str | None = None, config=None) -> torch.Tensor:
    """The GPU path. q: the float queries [B, Hq, Tq, D], quantized per spec.q_format (inside the
    split-KV kernel, or on the host for the prefill kernels), or with q_scale [B, Hq, Tq, 1] fp32 Q's
    code values; k, v as `attention` takes them. The attention kernel classes
    (lowbit.ops.kernels.attention) pick the kernel: split-KV (flash-decoding) for decode steps and short
    query blocks; otherwise `kernel` (a choosable class's name: "prefill", "flash" or "sdpa"), else a
    tuning table's choice, else the tensor-core prefill kernel where it runs the call and the general
    flash kernel elsewhere. config: the prefill kernel's PrefillConfig (lowbit.ops.triton.attention_prefill;
    None = its default heuristic). q is not checked for NaN/Inf here (no host synchronisation):
    `attention` does that. The path taken is last_path()."""
    ar.check_shapes(tuple(q.shape), _shape(k), _shape(v))
    call = AttentionCall.of(q, k, v, spec, q_scale)
    choice, config = attention_kernels.resolve(call, kernel, config)
    if choice.kernel is None:
        raise ValueError(f"no attention kernel runs this call ({choice.report()}); use backend='torch'")
    _LAST["path"] = choice.kernel.label(config)
    return choice.kernel.apply(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype, config=config)


def attention_kind(k, v, spec: ar.AttnSpec) -> str:
    """The tuning table's name for an attention call's kind: cache formats, Q and P formats, P block."""
    return kind_key(CacheOperand.of(k), CacheOperand.of(v), spec)


def prefill_options(D: int, Tq: int, p_block: int = 64) -> list[tuple[str, object]]:
    """Every (kernel, config) a tuning table may choose for a prefill call at head_dim D, Tq query
    tokens and P block p_block, each runnable as attention_triton(q, k, v, spec, kernel=kernel,
    config=config): the tensor-core prefill kernel in each of prefill_candidates' configurations,
    the general flash kernel and SDPA over the dequantized cache (config None)."""
    return attention_kernels.prefill_options(D, Tq, p_block)


def attention(q: torch.Tensor, k, v, spec: ar.AttnSpec | None = None, *, backend: str = "auto",
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantized attention (module docstring). backend: "auto" (Triton on CUDA, torch elsewhere),
    "torch", "triton" (attention_triton: the kernel lowbit.ops.kernels.attention picks), "sdpa" (torch
    SDPA in bf16 over the dequantized cache, lowbit.ops.attention_sdpa: not the P-quantized
    arithmetic; its reference is attention_reference.sdpa_bf16_reference), or "reference" (the
    float64 reference, cast). Returns [B, Hq, Tq, D] in out_dtype (default q.dtype)."""
    spec = spec or ar.AttnSpec()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    k, v = _as_kv(k, "k"), _as_kv(v, "v")
    out_dtype = out_dtype or q.dtype
    ar.check_shapes(tuple(q.shape), _shape(k), _shape(v))
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "triton":
        ar.quantize_q(q, None)                          # q's shape and finiteness, checked once here
        return attention_triton(q, k, v, spec, out_dtype=out_dtype)
    _LAST["path"] = backend
    if backend == "sdpa":
        ar.quantize_q(q, None)
        return sdpa_attention(q, k, v, spec, out_dtype=out_dtype)
    q_hat = ar.quantize_q(q, spec.q_format)
    if backend == "reference":
        kd = k.dequantize(torch.float32) if isinstance(k, KVQuant) else k.float()
        vd = v.dequantize(torch.float32) if isinstance(v, KVQuant) else v.float()
        return ar.attention_reference(q_hat, kd, vd, spec).out.to(q.device, out_dtype)
    return attention_torch(q_hat, k, v, spec).to(out_dtype)
