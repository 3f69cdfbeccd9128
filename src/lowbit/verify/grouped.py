"""check_grouped_linear: verify a grouped (MoE) GEMM's output and name the layout bug when it fails.

The operands are those of lowbit.ops.grouped: x [M_total, K], the token buffer sorted by expert
(rows offsets[e]:offsets[e+1] belong to expert e), w [E, N, K] the stacked expert weights. x is
quantized once over the concatenated M, each expert's weight on its own. The gate is
lowbit.verify.tolerance's implementation gate, per expert, against the float64 reference
lowbit.ops.grouped.grouped_reference.

A failing output is compared with exact simulations of the grouped GEMM's own bugs (each the
reference with one wrong index), named when the simulation reproduces the output within its
gate everywhere, best fit first. Scale "units" below are the words a kernel reads: four one-byte
scale codes per uint32 word for e8m0 / fp8 scale codes (lowbit.packing, group-major), one fp32
scale otherwise. The hypotheses:
  sfb_expert_axis    SFB read at g*E*N + n*E + e instead of g*E*N + e*N + n
  sfa_local_m        SFA read at g*M_e + m (the expert's own row count) instead of g*M_total + m
  sfa_row_major      SFA words read row-major (m*G + g) instead of group-major (g*M_total + m)
  sfb_row_major      SFB words read row-major ((e*N + n)*G + g) instead of group-major
  scales_of_next / scales_of_prev   expert e's rows multiplied with expert e+1's / e-1's scales
  empty_expert_shift  empty experts dropped from the expert list without remapping: the k-th
                     non-empty expert's rows use expert k's weight
  padding_leak_bm{B} the padding rows of each expert's last BLOCK_M = B tile written to the output:
                     rows after an expert's end, up to its padded end, get that expert's product
                     (where several experts' padding overlaps, the earliest expert's)
When no layout bug reproduces the output, a narrower accumulator than the promised one is tried
per expert (lowbit.verify.accumulate, as check_linear does): named, as a numerical failure, when
one accumulator reproduces every non-empty expert's block (or matches each block's error in size
and spread, "consistent"); the fp8 GEMMs of cuBLAS on Hopper accumulate so.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from lowbit.ops.grouped import grouped_reference, take_rows
from lowbit.ops.reference import as_operand
from lowbit.quantize import QTensor, quantize
from lowbit.scheme import get_preset
from lowbit.verify import accumulate as accmod
from lowbit.verify import metrics as mt
from lowbit.verify import tolerance as tol
from lowbit.verify.simulate import explained

PADDING_BLOCKS = (16, 32, 64, 128)


@dataclass
class GroupedVerdict:
    """passed; kind "ok" | "numerical" | "logic"; first_failure (row, col, expert) or None;
    metrics; causes: [(name, detail, worst |out - pred| / gate)] best fit first."""
    passed: bool
    kind: str
    first_failure: tuple[int, int, int] | None
    metrics: dict
    causes: list[tuple[str, str, float]] = field(default_factory=list)

    def report(self) -> str:
        m = self.metrics
        lines = [f"check_grouped_linear: {'PASS' if self.passed else 'FAIL'} ({self.kind})  [M_total={m['M_total']}, "
                 f"E={m['E']}, N={m['N']}, K={m['K']}, x: {m['x_scheme']}, w: {m['w_scheme']}, rows per expert "
                 f"{m['counts']}]",
                 f"  vs quantization-aware reference: rel L2 {m['rel_l2']:.3e}, {m['mismatch_ratio']:.2%} of outputs "
                 f"over the gate, worst err/gate {m['impl_gate_frac']:.3g}"]
        if self.first_failure is not None:
            r, c, e = self.first_failure
            lines.append(f"  first failure at row {r} (expert {e}), col {c}")
        for name, detail, worst in self.causes:
            lines.append(f"  cause: {name}: {detail} (simulation reproduces the output, worst err/gate {worst:.3g})")
        if not self.passed and not self.causes:
            lines.append("  no simulated grouped-GEMM bug reproduces the output")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def _scheme(s):
    if isinstance(s, str):
        return get_preset(s)
    return s


def _check_inputs(out, x, w, offsets):
    out, x, w = (torch.as_tensor(t).detach().cpu() for t in (out, x, w))
    offsets = torch.as_tensor(offsets).detach().cpu().to(torch.int64)
    if w.ndim != 3:
        raise ValueError(f"w must be the stacked expert weights [E, N, K], got shape {tuple(w.shape)}")
    E, N, K = w.shape
    if offsets.shape != (E + 1,) or int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets must be non-decreasing int [E + 1 = {E + 1}] from 0 (Routing.offsets), got "
                         f"{offsets.tolist()}")
    M = int(offsets[-1])
    if M == 0:
        raise ValueError("offsets describe 0 rows: nothing to check (a zero-token batch)")
    if x.ndim != 2 or tuple(x.shape) != (M, K):
        raise ValueError(f"x must be the sorted token buffer [M_total = {M}, K = {K}], got {tuple(x.shape)}")
    if tuple(out.shape) != (M, N):
        raise ValueError(f"out must be [M_total = {M}, N = {N}] (one row per sorted row, before routing weights), "
                         f"got {tuple(out.shape)}")
    return out, x, w, offsets


class _Grouped:
    """Quantized operands of one check and the (pred, gate) of edited ones."""

    def __init__(self, xq, wqs, offsets, bias, acc, out_dtype):
        self.xq, self.wqs, self.offsets, self.bias = xq, wqs, offsets, bias
        self.acc, self.out_dtype = acc, out_dtype
        self.E, self.M = len(wqs), int(offsets[-1])
        self.rows = [torch.arange(int(offsets[e]), int(offsets[e + 1])) for e in range(self.E)]
        self.expert = torch.repeat_interleave(torch.arange(self.E), offsets[1:] - offsets[:-1])

    def run(self, xq=None, wqs=None, expert_of=None):
        """(pred, gate) [M, N]: rows of expert e times weight expert_of[e] (default e)."""
        xq = self.xq if xq is None else xq
        wqs = self.wqs if wqs is None else wqs
        N = wqs[0].shape[0]
        pred = torch.zeros(self.M, N, dtype=torch.float64)
        gate = torch.zeros(self.M, N, dtype=torch.float64)
        for e, rows in enumerate(self.rows):
            if not rows.numel():
                continue
            k = e if expert_of is None else expert_of[e]
            xr = take_rows(xq, rows) if isinstance(xq, QTensor) else xq[rows]
            xo, wo = as_operand(xr, "x").dequantized(), as_operand(wqs[k], "w").dequantized()
            p, T = xo @ wo.T, xo.abs() @ wo.abs().T
            if self.bias is not None:
                p, T = p + self.bias[k], T + self.bias[k].abs()
            n, u = tol.rounding_count(xr, wqs[k], self.acc, self.bias is not None)
            pred[rows], gate[rows] = p, tol.gate_from_sum(T, p, n, u, self.out_dtype)
        return pred, gate


def _word(qt: QTensor) -> int:
    return 4 if qt.scale_codes is not None else 1


def _regather(scale: torch.Tensor, word: int, read) -> tuple[torch.Tensor, torch.Tensor]:
    """scale [R, G] laid out group-major in units of `word` scales: flat[g * R + r] = unit (r, g).
    read(g, r) -> the flat unit index a buggy kernel reads for (r, g) (tensors). Returns (the
    scales it gets [R, G], valid [R] rows whose reads stayed in the buffer)."""
    R, G = scale.shape
    Gu = G // word
    units = scale.reshape(R, Gu, word).permute(1, 0, 2).reshape(Gu * R, word)   # group-major flat
    g = torch.arange(Gu)[None, :].expand(R, Gu)
    r = torch.arange(R)[:, None].expand(R, Gu)
    idx = read(g, r)
    ok = (idx >= 0) & (idx < Gu * R)
    got = units[idx.clamp(0, Gu * R - 1)]                                         # [R, Gu, word]
    return got.reshape(R, G), ok.all(dim=1)


def _with_scale(qt: QTensor, scale: torch.Tensor) -> QTensor:
    return dataclasses.replace(qt, scale=scale.contiguous())


def hypotheses(g: _Grouped):
    """Yield (name, detail, pred, gate, mask) of every simulated grouped-GEMM bug that applies."""
    E, M = g.E, g.M
    wq0 = g.wqs[0]
    N = wq0.shape[0]
    counts = (g.offsets[1:] - g.offsets[:-1])
    quantized_w = isinstance(wq0, QTensor)            # unquantized weights have no scales to misread
    wscale = torch.stack([q.scale.reshape(N, -1) for q in g.wqs]) if quantized_w else torch.ones(E, N, 1)
    Gw = wscale.shape[2]
    wword = _word(wq0) if quantized_w else 1

    def w_hyp(name, detail, new_scale, valid=None):
        wqs = [_with_scale(q, new_scale[e].reshape(q.scale.shape)) for e, q in enumerate(g.wqs)]
        pred, gate = g.run(wqs=wqs)
        mask = None
        if valid is not None and not bool(valid.all()):
            mask = valid[g.expert][:, None].expand(M, N)
        return name, detail, pred, gate, mask

    if quantized_w and E > 1 and N > 1:
        flat = wscale.reshape(E * N, Gw)
        s, ok = _regather(flat, wword, lambda gg, r: gg * E * N + (r % N) * E + r // N)
        yield w_hyp("sfb_expert_axis", "SFB indexed g*E*N + n*E + e (expert along the wrong axis) instead of "
                    "g*E*N + e*N + n", s.reshape(E, N, Gw), ok.reshape(E, N).all(1))
    if quantized_w and Gw // wword >= 2:
        flat = wscale.reshape(E * N, Gw)
        s, ok = _regather(flat, wword, lambda gg, r: r * (Gw // wword) + gg)
        yield w_hyp("sfb_row_major", "SFB scale words read row-major ((e*N + n)*G + g) instead of group-major "
                    "(g*E*N + e*N + n)", s.reshape(E, N, Gw), ok.reshape(E, N).all(1))
    if E > 1:
        for step, name in ((1, "scales_of_next"), (-1, "scales_of_prev")):
            if quantized_w:
                s = wscale[[(e + step) % E for e in range(E)]]
                yield w_hyp(name, f"expert e's rows multiplied with expert e{step:+d}'s weight scales", s)
        nonempty = [e for e in range(E) if counts[e] > 0]
        if len(nonempty) < E:
            expert_of = {e: k for k, e in enumerate(nonempty)}
            pred, gate = g.run(expert_of=expert_of)
            yield ("empty_expert_shift", "empty experts dropped from the tile schedule without remapping: the k-th "
                   "non-empty expert's rows used expert k's weight", pred, gate, None)
    xq = g.xq
    if isinstance(xq, QTensor) and xq.scale.shape[0] == M:
        xs = xq.scale.reshape(M, -1)
        Gx, xword = xs.shape[1], _word(xq)
        if Gx // xword >= 2:
            m_e = counts[g.expert]                                                    # each row's expert size
            s, ok = _regather(xs, xword, lambda gg, r: gg * m_e[r] + r)
            pred, gate = g.run(xq=_with_scale(xq, s.reshape(xq.scale.shape)))
            yield ("sfa_local_m", "SFA indexed g*M_e + m with each expert's own M instead of the concatenated "
                   "g*M_total + m", pred, gate, None if bool(ok.all()) else ok[:, None].expand(M, N))
            s, ok = _regather(xs, xword, lambda gg, r: r * (Gx // xword) + gg)
            pred, gate = g.run(xq=_with_scale(xq, s.reshape(xq.scale.shape)))
            yield ("sfa_row_major", "SFA scale words read row-major (m*G + g) instead of group-major "
                   "(g*M_total + m)", pred, gate, None)
    ref, gref = g.run()
    for bm in PADDING_BLOCKS:
        pred, gate = ref.clone(), gref.clone()
        touched = False
        for e in reversed(range(E)):         # overlapping padding: the earliest expert's write lands last
            lo, hi = int(g.offsets[e]), int(g.offsets[e + 1])
            end = min(lo + -(-(hi - lo) // bm) * bm, M)
            if hi == lo or end <= hi:
                continue
            rows = torch.arange(hi, end)
            p, gt = _rows_times(g, rows, e)
            pred[rows], gate[rows] = p, gt
            touched = True
        if touched:
            yield (f"padding_leak_bm{bm}", f"padding rows of each expert's last BLOCK_M = {bm} tile written to the "
                   "output (rows after an expert's end got that expert's product)", pred, gate, None)


def _rows_times(g: _Grouped, rows: torch.Tensor, e: int):
    xr = take_rows(g.xq, rows) if isinstance(g.xq, QTensor) else g.xq[rows]
    xo, wo = as_operand(xr, "x").dequantized(), as_operand(g.wqs[e], "w").dequantized()
    p, T = xo @ wo.T, xo.abs() @ wo.abs().T
    if g.bias is not None:
        p, T = p + g.bias[e], T + g.bias[e].abs()
    n, u = tol.rounding_count(xr, g.wqs[e], g.acc, g.bias is not None)
    return p, tol.gate_from_sum(T, p, n, u, g.out_dtype)


def check_grouped_linear(out, x, w, offsets, *, x_scheme=None, w_scheme=None, bias=None,
                         accumulator: str | None = None, out_dtype: torch.dtype | None = None,
                         diagnose_failures: bool = True, w_q: list | None = None) -> GroupedVerdict:
    """Verify out [M_total, N] ~ per-expert x[rows of e] @ w[e].T (+ bias[e]) of a grouped kernel
    that quantizes x [M_total, K] (the sorted buffer, once over all rows) by x_scheme and each
    expert's w[e] [N, K] by w_scheme (original float values; lowbit quantizes them canonically).
    offsets: int [E + 1] (lowbit.ops.grouped.Routing.offsets). bias: [E, N] or None.
    accumulator / out_dtype: as check_linear ("int32" default for integer x integer).
    w_q: the experts' quantized weights (E QTensors) where the kernel's codes are given, not
    re-derived (a checkpoint's): the reference and gate use them; w is then their dequantized values."""
    out, x, w, offsets = _check_inputs(out, x, w, offsets)
    x_scheme, w_scheme = _scheme(x_scheme), _scheme(w_scheme)
    E, N, K = w.shape
    out_dtype = out_dtype or (out.dtype if out.is_floating_point() else torch.float32)
    xq = quantize(x.float(), x_scheme) if x_scheme is not None else x.double()
    if w_q is not None and len(w_q) != E:
        raise ValueError(f"w_q must hold one quantized weight per expert ({E}), got {len(w_q)}")
    wqs = list(w_q) if w_q is not None else \
        [quantize(w[e].float(), w_scheme) if w_scheme is not None else w[e].double() for e in range(E)]
    b64 = None if bias is None else torch.as_tensor(bias).detach().cpu().double().reshape(E, N)
    first_rows = take_rows(xq, torch.arange(1)) if isinstance(xq, QTensor) else xq[:1]
    acc = accumulator or tol.default_accumulator(first_rows, wqs[0])
    g = _Grouped(xq, wqs, offsets, b64, acc, out_dtype)
    ref = grouped_reference(xq, offsets, wqs, b64)
    _, gate = g.run()
    out64 = out.double()
    err = (out64 - ref).abs()
    bad = ~(err <= gate)
    passed = not bool(bad.any())
    first = None
    if not passed:
        r, c = divmod(int(torch.nonzero(bad.reshape(-1))[0]), N)
        first = (r, c, int(g.expert[r]))
    metrics = {"M_total": g.M, "E": E, "N": N, "K": K, "counts": (offsets[1:] - offsets[:-1]).tolist(),
               "x_scheme": str(x_scheme) if x_scheme else "unquantized",
               "w_scheme": str(w_scheme) if w_scheme else "unquantized", "accumulator": acc,
               "rel_l2": mt.rel_l2(out64, ref), "mismatch_ratio": float(bad.double().mean()),
               "impl_gate_frac": float(torch.nan_to_num(err / gate, nan=math.inf).max())}
    causes = []
    if not passed and diagnose_failures:
        for name, detail, pred, hgate, mask in hypotheses(g):
            ok, share, worst = explained(out64, ref, pred, hgate, mask)
            if ok and share > 0:
                causes.append((name, detail, worst))
        causes.sort(key=lambda c: c[2])
    kind = "ok" if passed else "logic"
    if not passed and diagnose_failures and not causes:
        acc_cause = _accumulator_cause(g, out64, ref, gate)
        if acc_cause is not None:
            causes, kind = [acc_cause], "numerical"
    return GroupedVerdict(passed, kind, first, metrics, causes)


def _accumulator_cause(g: _Grouped, out: torch.Tensor, ref: torch.Tensor, gate: torch.Tensor):
    """(name, detail, worst) when one accumulator narrower than the promised one explains every
    non-empty expert's block: reproduces all of them (exact), else matches each block's error in
    size and spread (consistent, worst = nan); None otherwise. An expert whose block passes is
    also checked: a narrow accumulator that leaves some blocks within the gate is still one."""
    found: dict[str, list] = {}
    blocks = [(e, rows) for e, rows in enumerate(g.rows) if rows.numel()]
    for e, rows in blocks:
        xr = take_rows(g.xq, rows) if isinstance(g.xq, QTensor) else g.xq[rows]
        bias = None if g.bias is None else g.bias[e]
        for m in accmod.match_accumulators(out[rows], ref[rows], gate[rows], xr, g.wqs[e], bias, g.acc):
            found.setdefault(m.accumulator, []).append(m)
    for exact in (True, False):
        for acc, ms in found.items():
            if len(ms) == len(blocks) and all(m.exact if exact else (m.exact or m.consistent) for m in ms):
                how = "reproduces every expert's block" if exact else "matches every expert's error in size and spread"
                worst = max(m.residual for m in ms) if exact else math.nan
                return ("accumulator_narrower_than_promised",
                        f"a {acc} accumulator ({ms[0].order}) {how}, although {g.acc} was promised: "
                        f"{accmod.NARROW_ADVICE} (accumulator=...)", worst)
    return None
