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
from lowbit.ops import dispatch
from lowbit.ops import tuning
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
    code values; k, v as `attention` takes them. lowbit.ops.dispatch.attention_kernel picks the
    kernel: split-KV (flash-decoding) for decode steps and short query blocks; for prefill
    `kernel` (a tuning table's choice: "prefill", "flash" or "sdpa") or, without one, the
    tensor-core prefill kernel where it runs the call and the general flash kernel elsewhere.
    config: the prefill kernel's PrefillConfig (lowbit.ops.triton.attention_prefill; None = its
    default heuristic). q is not checked for NaN/Inf here (no host synchronisation): `attention`
    does that. The path taken is last_path()."""
    from lowbit.ops.triton.attention import flash_attention    # optional: triton
    from lowbit.ops.triton.attention_decode import split_kv_attention    # optional: triton
    from lowbit.ops.triton.attention_prefill import prefill_attention, unsupported    # optional: triton
    G = ar.check_shapes(tuple(q.shape), _shape(k), _shape(v))
    q_exact = q_scale is not None or spec.q_format is not None or q.dtype == torch.bfloat16
    if kernel is None and config is None and q.shape[2] > 1:
        kernel, config = _tuned(q, k, v, spec, G, sdpa_ok=q_scale is None)
    name = dispatch.attention_kernel(q.shape[2], G, q_exact, dispatch.kv_kind(k), dispatch.kv_kind(v), kernel,
                                     unsupported(q_exact, k, v, spec))
    _LAST["path"] = name
    if name == "split_kv":
        return split_kv_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype)
    if name == "sdpa":
        if q_scale is not None:
            raise ValueError("the sdpa path takes the float queries, not Q's codes (q_scale): pass q itself")
        return sdpa_attention(q, k, v, spec, out_dtype=out_dtype)
    if q_scale is None and spec.q_format is not None:
        q, q_scale = ar.quantize_q_parts(q, spec.q_format)
    if name == "prefill":
        from lowbit.ops.triton.attention_prefill import default_config    # optional: triton
        cfg = config or default_config(q.shape[3], q.shape[2], spec.p_block)
        _LAST["path"] = f"prefill[{cfg}]"
        return prefill_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype, config=cfg)
    return flash_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype)


def attention_kind(k, v, spec: ar.AttnSpec) -> str:
    """The tuning table's name for an attention call's kind: cache formats, Q and P formats, P block."""
    return f"{dispatch.kv_kind(k)}/{dispatch.kv_kind(v)}/q-{spec.q_format}/p-{spec.p_format}/{spec.p_block}"


def _tuned(q, k, v, spec, G, sdpa_ok: bool) -> tuple[str | None, object]:
    """A tuning table's (kernel, config) for this prefill call, or (None, None) without a cell.
    Cells are keyed by (kind, head_dim, GQA group, bucket of the query length): path "dequant" is
    SDPA over the dequantized cache, "kernel" names the kernel (and the prefill kernel's tiles)."""
    from lowbit.ops.triton.attention_prefill import PrefillConfig   # triton: the optional [gpu] extra

    path, cfg = tuning.choose("attention", attention_kind(k, v, spec), q.shape[3], G, q.shape[2])
    if cfg is None:
        return ("sdpa", None) if path == "dequant" and sdpa_ok else (None, None)
    cfg = dict(cfg)
    which = cfg.pop("kernel", "prefill")
    return which, (PrefillConfig(**cfg) if which == "prefill" and cfg else None)


def prefill_options(D: int, Tq: int, p_block: int = 64) -> list[tuple[str, object]]:
    """Every (kernel, config) a tuning table may choose for a prefill call at head_dim D, Tq query
    tokens and P block p_block, each runnable as attention_triton(q, k, v, spec, kernel=kernel,
    config=config): the tensor-core prefill kernel in each of prefill_candidates' configurations,
    the general flash kernel and SDPA over the dequantized cache (config None)."""
    from lowbit.ops.triton.attention_prefill import prefill_candidates    # optional: triton
    return [("prefill", c) for c in prefill_candidates(D, Tq, p_block)] + [("flash", None), ("sdpa", None)]


def attention(q: torch.Tensor, k, v, spec: ar.AttnSpec | None = None, *, backend: str = "auto",
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantized attention (module docstring). backend: "auto" (Triton on CUDA, torch elsewhere),
    "torch", "triton" (attention_triton: the kernel lowbit.ops.dispatch picks), "sdpa" (torch
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
