"""Attention sites of the per-site report: per layer, how much the KV cache and the attention
quantization cost.

For each decoder layer, on one calibration batch: the float post-RoPE q, k, v are recorded (the
model's own attention runs unchanged), then
  K / V SQNR    the cache's quantization of k and v (the model's KV-cache scheme and scales)
  P SQNR        quantized P (per row and key block) against the exact softmax of the same scores
  out SQNR      quantized attention (Q, K, V, P as the spec says; the float64 reference) against
                float attention of the float q, k, v: the error attention hands to o_proj
  P zeros       the fraction of seen probabilities whose code is 0 (the softmax tail lost)
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lowbit.pipelines.attention_tap import attention_tap
from lowbit.nn.kv_cache import KVCacheQuant, kv_cache_disabled
from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import quantize_kv
from lowbit.verify.metrics import sqnr_db


@contextmanager
def _recording(model):
    """{layer index: (q, k, v as float32 CPU tensors, scaling)} of one forward's attention calls."""
    records = {}

    def tap(module, query, key, value, scaling, out):
        records[module.layer_idx] = (query.detach().float().cpu(), key.detach().float().cpu(),
                                     value.detach().float().cpu(), scaling)

    with attention_tap(model, tap):
        yield records


@dataclass
class AttnSite:
    layer: int
    k_sqnr: float
    v_sqnr: float
    p_sqnr: float
    out_sqnr: float
    p_zero: float


@dataclass
class AttnSiteReport:
    kv: str
    spec: str
    sites: list[AttnSite]
    p_quantized: bool = True    # False: P stays in high precision, its "SQNR" would be float64 rounding (~300 dB)

    def to_markdown(self) -> str:
        rows = ["| layer | K SQNR dB | V SQNR dB | P SQNR dB | attention out SQNR dB | P codes at 0 |",
                "|---:|---:|---:|---:|---:|---:|"]
        p = (lambda s: f"{s.p_sqnr:.1f} | {s.out_sqnr:.1f} | {100 * s.p_zero:.2f}%") if self.p_quantized else \
            (lambda s: f"- (not quantized) | {s.out_sqnr:.1f} | -")
        rows += [f"| {s.layer} | {s.k_sqnr:.1f} | {s.v_sqnr:.1f} | {p(s)} |" for s in self.sites]
        return "\n".join(rows)

    def __str__(self) -> str:
        worst = min(self.sites, key=lambda s: s.out_sqnr)
        return (f"attention sites (KV {self.kv}; {self.spec}): worst attention output SQNR "
                f"{worst.out_sqnr:.1f} dB at layer {worst.layer}\n" + self.to_markdown())


def _sq(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return sqnr_db(ref.reshape(-1, ref.shape[-1]), approx.reshape(-1, ref.shape[-1]))


@torch.no_grad()
def attention_site_report(model, batch, kv: KVCacheQuant | None, spec: ar.AttnSpec | None = None) -> AttnSiteReport:
    """The attention rows for one batch of token ids [B, T] (keep T moderate: the float64
    reference holds [B, Hq, T, T] scores). kv: the model's KV-cache quantization (None: float
    cache); spec: the attention quantization (default: Q and P unquantized, so the rows show the
    cache's cost alone)."""
    spec = spec or ar.AttnSpec(q_format=None, p_format=None)
    ids = batch if isinstance(batch, torch.Tensor) else torch.as_tensor(batch)
    ctx = kv_cache_disabled(model) if hasattr(model, "lowbit_kv_cache") else _null()
    with ctx, _recording(model) as rec:
        model(input_ids=ids.to(next(model.parameters()).device))
    if not rec:
        raise ValueError("no attention module reported its inputs: the model does not use transformers' "
                         "attention interface")
    sites = []
    for i in sorted(rec):
        q, k, v, scaling = rec[i]
        s = spec if scaling is None else ar.AttnSpec(spec.q_format, spec.p_format, spec.p_block, True, scaling)
        if kv is not None:
            ks, vs = kv.layer_scales(i)
            kq, vq = quantize_kv(k, kv.scheme, ks), quantize_kv(v, kv.scheme, vs)
            kh, vh = kq.dequantize(), vq.dequantize()
        else:
            kh, vh = k, v
        q_hat = ar.quantize_q(q, s.q_format)
        ref = ar.attention_reference(q_hat, kh, vh, s, return_p=True)
        exact = ar.sdpa_float64(q, k, v, True, s.sm_scale)
        G = q.shape[1] // k.shape[1]
        scores = (q_hat.double() @ kh.double().repeat_interleave(G, 1).transpose(-1, -2)) * s.scale_for(q.shape[-1])
        allowed = ar.allowed_mask(q.shape[2], k.shape[2], True)
        p_exact = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        sites.append(AttnSite(i, _sq(k.double(), kh.double()), _sq(v.double(), vh.double()),
                              _sq(p_exact, ref.p), _sq(exact, ref.out), ref.p_zero_fraction))
    return AttnSiteReport(str(kv.scheme) if kv is not None else "unquantized",
                          _qp_text(spec), sites, spec.p_format is not None)


def _qp_text(spec) -> str:
    """How Q and P are held, in words (None is the high-precision case, not a format name)."""
    q = "high precision" if spec.q_format is None else spec.q_format
    p = "high precision" if spec.p_format is None else f"{spec.p_format} per {spec.p_block}-key block"
    return f"Q {q}, P {p}"


@contextmanager
def _null():
    yield
