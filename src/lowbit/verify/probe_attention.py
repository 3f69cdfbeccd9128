"""Characterize an attention kernel's two accumulators with test vectors (`lowbit probe --attention`).

    fit = probe_attention(kernel, "fp8")      # kernel(q, k, v, sm_scale) -> out
    fit.qk, fit.pv                            # verify.probe.Fit: bits, rounding, block, promote

The kernel is any callable computing full (non-causal) softmax attention out = softmax(q k^T *
sm_scale) v over q [B, H, Tq, D], k, v [B, H, Tk, D] (float64 tensors whose values are exact in the
kernel's input format: it must take them with unit scales) and returning out [B, H, Tq, D] (its
float32 output). The accumulator model is verify.probe's fused multi-term adder (fraction bits,
rounding, products per step, promotion into fp32), fitted by verify.probe.fit.

P.V (over keys): every score equal (q = k = e_0), so every weight P is 1 whatever P's format and
l = Tk; with Tk a power of two, out * Tk is the P.V accumulator's sum of V's column, exactly. Each
column of V carries one test vector (verify.probe's sets, built of single values exact in V's
format: `terms`), so `promote` is the promotion interval over keys (FlashAttention-3's two-level
accumulation promotes once per key block; the 128k fp8 failure never did).

Q.K^T (over head_dim): a score only reaches the output through the softmax, so it is read as a
difference: per head one query q and two keys, the test vector k_a at key 0 and a reference k_b
whose score is a single product (exact in any accumulator) at the last key, every key between them
a filler whose score is far below (weight 0). The two keys sit in different key blocks (a kernel
scaling P per block gives each its own maximum, so P's rounding hides nothing), V = e_0 at k_a and
e_1 at k_b, and out[0] / out[1] = 2^((s_a - s_b) sm_scale log2(e)): s_a = s_b + log2(out[0] /
out[1]) / (sm_scale log2(e)). The read-out is not exact (fp32 exp2 and output, and the scaled
score rounded to fp32 before the exponent), so a model agrees when it predicts every score within
1/8 of the smallest term of its vector: the candidates of a vector differ by at least a quarter of
it. The lower-scored key comes first, so each tested key is the running maximum when its block is
reached: its P is 1 in any P format and the ratio lives in the fp32 rescale of O. Scores around
2^8 with sm_scale 1/2 (exponents ~185 in log2 units, fp32 steps of 2^-16) keep the read-out's
error (~2^-15 in score units) below that tolerance up to QK_READ_BITS fraction bits, and a narrow
P.V accumulator (14 significant bits, truncating the rescaled O) at 2^-12; an accumulator keeping
more than QK_READ_BITS is reported as at least that many.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.verify import probe as P

SM_SCALE = 0.5                        # a power of two: the scaled score is exact
QK_E = 8                              # the bits / round vectors' big exponent: scores ~2^8, read out well
QK_READ_BITS = 18                     # fraction bits the score read-out resolves (module docstring)
QK_KEYS = 129                         # key 0 and key 128 lie in different blocks for blocks <= 128 keys
PV_KEYS = 1024                        # a power of two: l = PV_KEYS exactly, out * PV_KEYS exact
FILLER_LOG2 = 150.0                   # a filler's weight at most 2^-150 of the tested keys': 0 in fp32
FORMATS = {"fp8": (-9, 8), "fp16": (-24, 15), "bf16": (-60, 60)}   # powers of two exact in each (probe.py's)


@dataclass
class AttentionFit:
    qk: P.Fit
    pv: P.Fit

    def as_dict(self) -> dict:
        return {"qk": self.qk.as_dict(), "pv": self.pv.as_dict()}


def terms(emin: int, emax: int, k: int) -> P.Vectors:
    """verify.probe's three sets (as (ones, terms)) with every term a single value exact in a format
    whose powers of two span 2^emin .. 2^emax: the big value 2^E, E = min(emax, 30), and in the
    block set the small ones 2^lo, lo = max(emin, E - 40), which a fused step holding 2^E loses for
    accumulators of up to E - lo - 2 fraction bits."""
    E = min(emax, 30)
    lo = max(emin, E - 40)
    js = torch.tensor([j for j in range(1, 41) if E - j >= lo])
    R = len(js)
    bits = torch.zeros(R, k, dtype=torch.float64)
    bits[:, 0], bits[:, 1] = 2.0 ** E, torch.exp2((E - js).double())
    jr = js[E - js - 1 >= lo + 1]                     # 1.5 * 2^x is exact from x = lo + 1 on
    rnd = torch.zeros(2 * len(jr), k, dtype=torch.float64)
    for sgn, rows in ((1.0, slice(0, len(jr))), (-1.0, slice(len(jr), 2 * len(jr)))):
        rnd[rows, 0], rnd[rows, 1] = sgn * 2.0 ** E, sgn * 1.5 * torch.exp2((E - jr - 1).double())
    ps = P.block_positions(k)
    block = torch.full((len(ps), k), 2.0 ** lo, dtype=torch.float64)
    block[:, 0] = 2.0 ** E
    block[torch.arange(len(ps)), torch.tensor(ps)] = -2.0 ** E
    return P.Vectors({name: (torch.ones_like(t), t) for name, t in (("bits", bits), ("round", rnd), ("block", block))},
                     E, ps)


def _pv_outputs(kernel, vec: P.Vectors, D: int) -> dict:
    outs = {}
    for name, (_, t) in vec.sets.items():
        R = t.shape[0]
        H = -(-R // D)
        v = torch.zeros(1, H * D, PV_KEYS, dtype=torch.float64)
        v[0, :R] = t
        v = v.reshape(1, H, D, PV_KEYS).transpose(2, 3).contiguous()          # column d of head h = row h*D + d
        q = torch.zeros(1, H, 1, D, dtype=torch.float64)
        k = torch.zeros(1, H, PV_KEYS, D, dtype=torch.float64)
        q[..., 0], k[..., 0] = 1.0, 1.0                                        # every score 1: every weight 1
        out = torch.as_tensor(kernel(q, k, v, SM_SCALE)).detach().cpu().double()
        outs[name] = out[0, :, 0, :].reshape(-1)[:R] * PV_KEYS
    return outs


def probe_pv(kernel, emin: int, emax: int, D: int = 128) -> P.Fit:
    """The P.V accumulator of `kernel` (module docstring); V's values span 2^emin .. 2^emax."""
    vec = terms(emin, emax, PV_KEYS)
    return P.fit(_pv_outputs(kernel, vec, D), vec)


def _qk_vectors(emin: int, emax: int, D: int) -> P.Vectors:
    small = P.vectors(emin, emax, D, E=QK_E)
    js = [j for j in range(1, 41) if QK_E - j - 1 >= 2 * emin + 1]     # the rows vectors() builds
    keep = torch.tensor(js) <= QK_READ_BITS
    bits = tuple(t[keep] for t in small.sets["bits"])
    # the rounding rows that tell an n-bit accumulator's rounding are j = n - 1 and n; beyond
    # QK_READ_BITS - 2 they would need bits the read-out does not resolve
    near = torch.tensor(js) <= QK_READ_BITS - 2
    rnd = tuple(t[torch.cat([near, near])] for t in small.sets["round"])
    big = P.vectors(emin, emax, D)
    return P.Vectors({"bits": bits, "round": rnd, "block": big.sets["block"]}, QK_E, big.block_rows)


def _qk_outputs(kernel, vec: P.Vectors, emax: int) -> tuple[dict, dict]:
    """(measured s_a per set, tolerance per set)."""
    c = SM_SCALE / math.log(2.0)
    outs, tols = {}, {}
    for name, (a, b) in vec.sets.items():
        R, D = a.shape
        ref = torch.zeros(R, D, dtype=torch.float64)
        if name != "block":                              # reference score a0 * b0 = +-2^E; block: 0
            ref[:, 0] = b[:, 0]
        s_ref = (a * ref).sum(1)
        prods = a * b
        big = prods.abs().amax(1, keepdim=True)
        # any score a model gives: within the sum of the terms below the largest of the exact sum
        reach = prods.sum(1).abs() + torch.where(prods.abs() < big, prods.abs(), 0.0).sum(1)
        need = (s_ref.abs() + reach + FILLER_LOG2 / c) / a[:, 0].abs()
        M = torch.exp2(torch.ceil(torch.log2(need)))
        if bool((M > 2.0 ** emax).any()):
            raise ValueError("the probe's filler keys do not fit the input format; give a wider format")
        # the lower score first: each tested key is the running maximum when its block is reached,
        # so its P is 1 in any P format, and the ratio lives in the fp32 rescale of O
        a_first = (a[:, 0] * b[:, 0] < 0) if name != "block" else torch.zeros(R, dtype=torch.bool)
        ia = torch.where(a_first, 0, QK_KEYS - 1)
        ib = QK_KEYS - 1 - ia
        rows = torch.arange(R)
        k = torch.zeros(1, R, QK_KEYS, D, dtype=torch.float64)
        k[0, :, 1:-1, 0] = (-M * torch.sign(a[:, 0]))[:, None]
        k[0, rows, ia], k[0, rows, ib] = b, ref
        v = torch.zeros(1, R, QK_KEYS, D, dtype=torch.float64)
        v[0, rows, ia, 0], v[0, rows, ib, 1] = 1.0, 1.0
        out = torch.as_tensor(kernel(a.reshape(1, R, 1, D), k, v, SM_SCALE)).detach().cpu().double()[0, :, 0]
        outs[name] = s_ref + torch.log2(out[:, 0] / out[:, 1]) / c
        tols[name] = torch.where(prods != 0, prods.abs(), math.inf).amin(1) / 8
    return outs, tols


def probe_qk(kernel, emin: int, emax: int, D: int = 128) -> P.Fit:
    """The Q.K^T accumulator of `kernel` (module docstring); q and k span 2^emin .. 2^emax."""
    vec = _qk_vectors(emin, emax, D)
    outs, tols = _qk_outputs(kernel, vec, emax)

    def agree(name, simulated, measured):
        return bool(((simulated - measured).abs() <= tols[name]).all())
    f = P.fit(outs, vec, agree)
    if f.fitted and f.bits is not None and f.bits >= QK_READ_BITS:
        f.bits = QK_READ_BITS
        f.note = "; ".join(x for x in (f"at least {QK_READ_BITS} fraction bits: the scores, read through the "
                                       "softmax, cannot show more (nor its rounding)", f.note) if x)
    return f


def probe_attention(kernel, fmt: str = "fp8", head_dim: int = 128) -> AttentionFit:
    """Fit both accumulators of an attention kernel whose inputs are in `fmt` (fp8 | fp16 | bf16)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)} (the kernel's input format), got {fmt!r}")
    if head_dim < 2 * max(P.BLOCKS[:4]) or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    lo, hi = FORMATS[fmt]
    return AttentionFit(probe_qk(kernel, lo, hi, head_dim), probe_pv(kernel, lo, hi, head_dim))


def describe(fit: AttentionFit, name: str = "attention") -> str:
    """Both fits as two lines, in verify.probe.describe's words."""
    table = {"paths": {f"{name} Q.K^T": fit.qk.as_dict(), f"{name} P.V": fit.pv.as_dict()}}
    return "\n".join(P.describe(table).splitlines()[1:])
