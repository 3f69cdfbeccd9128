"""A flash-attention kernel written for the tests (independent of lowbit.ops.attention and of the
float64 reference): block-by-block online softmax with P quantized per (row, key block), one bug at a
time switched on, and P.V optionally summed in the H200's fp8 tensor-core accumulator."""
import math

import torch

from lowbit.formats import decode, encode


def _truncated_sum(terms, bits=13):
    """Sum terms [..., n] as one fp8 MMA step: aligned to the largest exponent among them, each
    truncated toward zero to `bits` fraction bits below it, then added exactly (float64)."""
    top = torch.frexp(terms.abs().amax(dim=-1, keepdim=True)).exponent - 1
    unit = torch.ldexp(torch.ones_like(terms[..., :1]), top - bits)
    return (torch.trunc(terms / unit) * unit).sum(dim=-1)


def flash_attention(q_hat, k_hat, v_hat, spec, bug=None, *, dtype=torch.float32, pv="exact", promote=0):
    """Block-by-block online softmax in `dtype` with one optional bug.

    pv: how P.V is summed: "exact" (in dtype), or "fp8_fast": the H200's fp8 tensor-core accumulator
    (each 32-key step aligns its products and the running partial to the largest exponent among
    them and keeps 13 fraction bits, truncated), the partial added into O every `promote` keys
    (0: never, the whole context in the narrow accumulator)."""
    B, Hq, Tq, D = q_hat.shape
    G = Hq // k_hat.shape[1]
    Tk = k_hat.shape[2]
    kk = k_hat.to(dtype).repeat_interleave(G, 1)
    vv = v_hat.to(dtype).repeat_interleave(G, 1)
    c = spec.scale_for(D) / math.log(2.0)
    fmax = spec.p_max
    i = torch.arange(Tq)[:, None] + (Tk - Tq)
    lowdt = {"o_accumulated_bf16": torch.bfloat16, "o_accumulated_fp16": torch.float16}.get(bug)
    acc = torch.zeros(B, Hq, Tq, D, dtype=dtype)
    lo, done = torch.zeros_like(acc), 0
    l = torch.zeros(B, Hq, Tq, 1, dtype=dtype)
    m = torch.full((B, Hq, Tq, 1), -math.inf, dtype=dtype)
    for s0 in range(0, Tk, spec.p_block):
        j = torch.arange(s0, min(s0 + spec.p_block, Tk))[None, :]
        seen = (j <= i) if spec.causal else torch.ones(Tq, j.shape[1], dtype=torch.bool)
        t = (q_hat.to(dtype) @ kk[:, :, j[0]].transpose(-1, -2)) * c
        tm = t if bug == "causal_mask_after_p" else t.masked_fill(~seen, -math.inf)
        mb = tm.amax(-1, keepdim=True)
        mnew = torch.maximum(m, mb)
        ref = mnew if bug == "p_scale_per_tensor" else mb
        x = torch.where(torch.isfinite(ref), torch.exp2(tm - ref.nan_to_num(neginf=0.0)), torch.zeros_like(tm))
        x = torch.where(torch.isinf(tm), torch.zeros_like(x), x)
        v = x * fmax
        if spec.p_format == "int8":
            codes = torch.round(v).clamp(0, 127)
        elif spec.p_format is not None:
            codes = decode(encode(v, spec.p_format), spec.p_format)
        else:
            codes = v
        if bug == "causal_mask_after_p":
            codes = codes * seen
        f = torch.where(torch.isfinite(ref), torch.exp2(ref.nan_to_num(neginf=0.0) - mnew), torch.zeros_like(ref))
        p = codes * (f / fmax)
        alpha = torch.where(torch.isfinite(m), torch.exp2(m - mnew), torch.zeros_like(m))
        a_o = 1.0 if bug in ("rescale_skipped", "rescale_wrong_accumulator") else alpha
        a_l = 1.0 if bug == "rescale_skipped" else alpha
        if pv == "exact":
            acc = acc * a_o + p @ vv[:, :, j[0]]
        else:
            acc, lo = acc * a_o, lo * a_o
            prods = p[..., :, None, :] * vv[:, :, j[0]].transpose(-1, -2)[..., None, :, :]   # [B, H, Tq, D, n]
            for s in range(0, prods.shape[-1], 32):
                lo = _truncated_sum(torch.cat([lo[..., None], prods[..., s:s + 32]], dim=-1))
                done += prods[..., s:s + 32].shape[-1]
                if promote and done % promote == 0:
                    acc, lo = acc + lo, torch.zeros_like(lo)
        if lowdt is not None:
            acc = acc.to(lowdt).float()
        l = l * a_l + p.sum(-1, keepdim=True)
        m = mnew
    return (acc + lo) / l
