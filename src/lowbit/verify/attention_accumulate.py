"""The P.V accumulators an attention kernel may really use, simulated on the reference's own weights.

lowbit.ops.attention_reference sums P.V exactly and gates it by the accumulator the spec promises
(AttnSpec.pv_acc / pv_promote). When a kernel fails, each accumulator narrower than the promise is
simulated here in the reference's own order (per key block: the rescale, then the block's products
added to the narrow partial, which is added into an fp32 O every `pv_promote` keys or never):
- fp8_fast: the H200's fp8 tensor-core step (verify/accumulate.aligned_sum: 32 products and the
  partial aligned to the largest exponent, 13 fraction bits kept, truncated), the accumulator vLLM's
  fp8 FlashAttention-3 path kept O in across 128k keys;
- bf16 / fp16: rounded after every product (one key at a time; only up to SEQUENTIAL_KEYS keys,
  since the simulation is a Python loop over keys).
A simulation is a match when it explains most of the kernel's error (share of the error energy >=
MATCH_SHARE) with the same size (rms within RMS_FACTOR), and it is confirmed when it reproduces every
output within the promised gate, as tightly as a correct kernel reproduces the reference.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops import attention_reference as ar
from lowbit.verify.accumulate import RMS_FACTOR, aligned_sum, round_half

MATCH_SHARE = 0.5          # half the error's energy: the simulated mechanism, not a coincidence
SEQUENTIAL_KEYS = 8192     # bf16 / fp16 partials are simulated one key at a time up to this context


def pv_step(acc: str):
    """(partial [.., Tq, D], w [.., Tq, n], V [.., n, D]) -> the partial after adding w @ V in `acc`."""
    if acc == "fp8_fast":
        def fp8_fast(part, w, V):
            for a in range(0, w.shape[-1], ar.FP8_STEP):
                s = slice(a, a + ar.FP8_STEP)
                prod = w[..., :, None, s] * V[..., s, :].transpose(-1, -2)[..., None, :, :]   # [.., Tq, D, 32]
                part = aligned_sum(torch.cat([part[..., None], prod], dim=-1), ar.FP8_FAST_BITS)
            return part
        return fp8_fast
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[acc]

    def half(part, w, V):
        for j in range(w.shape[-1]):
            part = round_half(part + w[..., j:j + 1] * V[..., j:j + 1, :], dt)
        return part
    return half


def candidates(spec: ar.AttnSpec, Tk: int) -> list[ar.AttnSpec]:
    """Specs whose P.V accumulator is narrower than `spec` promises at context Tk: fp8_fast never
    promoted and promoted once per key block, bf16 and fp16 never promoted (short contexts only)."""
    promised = 0.0 if spec.pv_acc == "fp32" else ar.accumulation_factor(spec.pv_acc, spec.pv_stretch(Tk))
    out = []
    for acc, promote in (("fp8_fast", 0), ("fp8_fast", max(spec.p_block, ar.FP8_STEP)), ("bf16", 0), ("fp16", 0)):
        if acc != "fp8_fast" and Tk > SEQUENTIAL_KEYS:
            continue
        cand = dataclasses.replace(spec, pv_acc=acc, pv_promote=promote)
        if ar.accumulation_factor(acc, cand.pv_stretch(Tk)) > promised and (acc, cand.pv_stretch(Tk)) != \
                (spec.pv_acc, spec.pv_stretch(Tk)):
            out.append(cand)
    return out


def describe(spec: ar.AttnSpec, Tk: int) -> str:
    """The P.V accumulation `spec` declares, in words."""
    if spec.pv_acc == "fp32":
        return "fp32"
    n = spec.pv_stretch(Tk)
    return f"{spec.pv_acc}, " + ("never promoted (the whole context)" if n >= Tk else f"promoted into fp32 every {n} keys")


@dataclass
class PVMatch:
    spec: ar.AttnSpec          # the simulated kernel's accumulator
    share: float               # share of the kernel's error energy the simulation explains
    rms_ratio: float           # rms(simulated error) / rms(kernel's error)
    confirmed: bool            # every output within the promised gate of the simulation
    rel_err: float             # the simulation's relative L2 error against the reference
    fix_rel_err: float         # the same accumulator promoted once per key block


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-300))


def match(out64, ref, q_hat, kd, vd, spec: ar.AttnSpec, out_dtype) -> PVMatch | None:
    """The narrower P.V accumulator whose simulation explains the kernel's error best, or None."""
    Tk = kd.shape[2]
    err = out64 - ref.out
    en = float((err * err).sum())
    if en == 0 or not bool(torch.isfinite(out64).all()):
        return None
    best = None
    for cand in candidates(spec, Tk):
        sim = ar.attention_reference(q_hat, kd, vd, cand, out_dtype=out_dtype, pv_accumulate=pv_step(cand.pv_acc))
        se = sim.out - ref.out
        share = 1.0 - float(((out64 - sim.out) ** 2).sum()) / en
        ratio = math.sqrt(float((se * se).sum()) / en)
        if share < MATCH_SHARE or not (1 / RMS_FACTOR <= ratio <= RMS_FACTOR):
            continue
        if best is None or share > best[1]:
            best = (cand, share, ratio, bool(((out64 - sim.out).abs() <= ref.gate).all()), _rel(sim.out, ref.out))
    if best is None:
        return None
    cand = best[0]
    fix = dataclasses.replace(cand, pv_promote=max(spec.p_block, ar.FP8_STEP) if cand.pv_acc == "fp8_fast" else spec.p_block)
    fixed = ar.attention_reference(q_hat, kd, vd, fix, out_dtype=out_dtype, pv_accumulate=pv_step(cand.pv_acc))
    return PVMatch(cand, best[1], best[2], best[3], best[4], _rel(fixed.out, ref.out))
