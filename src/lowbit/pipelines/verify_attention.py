"""Attention over a checkpoint's quantized KV cache, checked layer by layer (verify_model's
`attention` kind).

For one forward, the model's own attention implementation (transformers' sdpa / eager / flash, or
lowbit's quantized attention after lowbit.nn.kv_cache.enable_quantized_attention) runs under
lowbit.pipelines.attention_tap, which hands each call's post-RoPE queries, the keys and values it read and
its output to `recorder`'s tap. Per layer:
1. The K and V the attention read must be the cache's codes x scales in the model's dtype, bit for
   bit (LowbitKVLayer.quantized() after the forward). Anything else is a cache bug: logic,
   `kv_cache_read`, with the first differing (batch, head, token, dim).
2. The output of the last `rows` queries of every sequence (those that see the most keys) is
   checked by lowbit.verify.check_attention against the float64 reference of what the
   implementation computes, with its derived gate and diagnosis:
   - lowbit's quantized attention: its AttnSpec (Q and P codes, P per key block, O in fp32);
   - any other implementation: unquantized Q and P, fp32 scores and accumulation (UNQUANTIZED);
     in bf16 the output is first held to sdpa_bf16_reference's gate (P rounded to bf16, fp32
     accumulation: what flash / cuDNN / memory-efficient SDPA do), so a correct bf16 kernel
     passes, and check_attention names what a failing one does.
The exact path (verify_model's end-to-end yardstick) replaces each attention output by the float64
reference of the same spec (`exact_tap`).
Not checked, and listed: attention that is not causal softmax attention over every cached key
(sliding windows, logit soft-capping, attention sinks), and models whose class does not dispatch
attention through transformers' AttentionInterface.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.nn import kv_cache as kvc
from lowbit.pipelines.attention_tap import Tap
from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import KVQuant
from lowbit.verify import metrics as mt
from lowbit.verify.attention import check_attention

# An unquantized kernel's key tile is not known from outside: 16 keys, the smallest tile, makes the
# gate count the most online-softmax rescales any kernel performs (lowbit audit's SDPA rows are held
# to the same). The diagnosis simulates bugs in 16-key blocks: a kernel with other tiles and, say, a
# skipped rescale is still a logic verdict, named `unexplained`.
UNQUANTIZED = ar.AttnSpec(q_format=None, p_format=None, p_block=16, causal=True)
QUANTIZED = {"fp8": ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn"),
             "int8": ar.AttnSpec(q_format="int8", p_format="int8")}


def unsupported(module) -> str | None:
    """Why this attention module is no causal softmax attention over every cached key, or None."""
    if getattr(module, "sliding_window", None):
        return "a sliding window"
    if getattr(getattr(module, "config", None), "attn_logit_softcapping", None):
        return "logit soft-capping"
    if getattr(module, "sinks", None) is not None:
        return "attention sinks"
    return None


def layer_spec(module, implementation: str, scaling: float | None) -> ar.AttnSpec:
    """The AttnSpec the implementation computes for `module`."""
    if implementation == kvc.NAME:
        return kvc.module_attn_spec(module, scaling)
    return dataclasses.replace(UNQUANTIZED, sm_scale=scaling)


@dataclass
class Seen:
    """One attention call: q, out [B, Hq, r, D] of the last r queries; k, v [B, Hkv, T, D] as read."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scaling: float | None


def recorder(rows: int) -> tuple[dict, Tap]:
    """({module: Seen} filled by the first call of each attention module, the tap that fills it)."""
    seen: dict = {}

    def tap(module, query, key, value, scaling, out):
        if module not in seen:
            r = min(rows, query.shape[2])
            seen[module] = Seen(query.detach()[:, :, -r:].cpu(), key.detach().cpu(), value.detach().cpu(),
                                out.detach().transpose(1, 2)[:, :, -r:].cpu(), scaling)
        return None
    return seen, tap


def exact_tap(implementation: str) -> Tap:
    """A tap that replaces every attention output by its float64 reference, in the output's dtype."""
    def tap(module, query, key, value, scaling, out):
        if unsupported(module) is not None:
            return None
        spec = layer_spec(module, implementation, scaling)
        q_hat = ar.quantize_q(query.detach().cpu().float(), spec.q_format)
        ref = ar.attention_reference(q_hat, key.detach().cpu().float(), value.detach().cpu().float(), spec)
        return ref.out.transpose(1, 2).to(out.dtype).to(out.device)
    return tap


def _first_difference(read: torch.Tensor, want: torch.Tensor) -> str:
    diff = read.double() - want.double()
    bad = ~(diff == 0)
    at = tuple(int(i) for i in bad.nonzero()[0])
    return f"first differing (batch, head, token, dim) {at}, {int(bad.sum())} of {bad.numel()} values differ"


@dataclass
class AttnLayerCheck:
    verdict: str                 # "ok" | "numerical" | "logic"
    worst_over_gate: float
    rel_err: float
    cause: str = ""


def check_layer(seen: Seen, cached: tuple[KVQuant, KVQuant], spec: ar.AttnSpec) -> AttnLayerCheck:
    """Step 1 and 2 of the module docstring for one layer."""
    for side, read, c in (("K", seen.k, cached[0]), ("V", seen.v, cached[1])):
        want = c.dequantize(read.dtype).to(read.device)   # the cache lives on the GPU, the capture on the host
        if tuple(read.shape) != tuple(want.shape) or not torch.equal(read, want):
            where = _first_difference(read, want) if read.shape == want.shape else \
                f"shape {tuple(read.shape)} against the cache's {tuple(want.shape)}"
            return AttnLayerCheck("logic", math.inf, math.nan,
                                  f"kv_cache_read: the attention read {side} values that are not the cache's codes x "
                                  f"scales in {read.dtype} ({where}): the cache's update or dequantization is wrong")
    q, k, v, out = seen.q.float(), seen.k.float(), seen.v.float(), seen.out
    o64 = out.double()
    if out.dtype == torch.bfloat16 and spec.q_format is None and spec.p_format is None:
        ref = ar.sdpa_bf16_reference(q, k, v, True, spec.sm_scale, out_dtype=torch.bfloat16)
        worst = float(torch.nan_to_num((o64 - ref.out).abs() / ref.gate, nan=math.inf).max())
        if worst <= 1.0:
            return AttnLayerCheck("ok", worst, mt.rel_l2(o64.reshape(-1, o64.shape[-1]),
                                                         ref.out.reshape(-1, o64.shape[-1])))
    vd = check_attention(out, q, k, v, spec, out_dtype=out.dtype)
    return AttnLayerCheck(vd.kind, vd.metrics["impl_gate_frac"], vd.metrics["rel_l2"],
                          str(vd.causes[0]) if vd.causes else "")
