"""Name the cause of a mismatch, or say honestly that it is unknown.

Order of questions (each answer is a simulation, never a bound that almost anything fits):
0. Are there non-finite outputs? Their source is named first (verify/nonfinite.py: a zero, subnormal
   or overflowing scale, a sum past the output's range, or where they lie), then the finite outputs
   go through the questions below on their own.
1. Does one named bug reproduce the output? Every hypothesis in verify/hypotheses.py (a scale
   missing / twice / inverted / broadcast, a K tail dropped, codes decoded with the wrong format,
   a row shift, ...) is simulated exactly in float64; a bug is CONFIRMED when its simulation matches
   the output within the gate of the buggy computation everywhere. Confirmed causes come first,
   the closest first; simulations that coincide on this data are reported together.
2. Is it a narrower accumulator than promised? verify/accumulate.py re-sums the reference's own
   products with fp16 / bf16 / fp32 / fp8-fast rounding in the orders kernels use; the claim is
   made only when one reproduces the output, or when the kernel's error has the simulated error's
   size and spread (rms, largest error, every row and column). Numerical, not logic.
3. Is the output close to the unquantized product but not to the scheme's quantization? Then
   the kernel quantizes differently (logic: different_quantization).
4. Is the error at most twice the bound, spread evenly? Numerical (over_budget_evenly): the
   bound assumes round-to-nearest; a rounding toward zero somewhere doubles it.
5. Otherwise: logic, `unexplained_logic_error`, with the evidence (where the error lives by row,
   column and K block, its size and sign, whether it is proportional to the output), followed by
   random processes consistent with it (stochastic rounding: simulated by its mean and a bound,
   never confirmed; an accumulator whose error merely has the right size is then listed, not
   claimed) and the hypotheses that explain most of it, each with the share it explains. Never a
   wrong name.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops.reference import as_operand
from lowbit.verify import accumulate as accmod
from lowbit.verify import hypotheses as hy
from lowbit.verify import nonfinite
from lowbit.verify.simulate import _q

PARTIAL = 0.8            # a hypothesis explaining >= 80% of the error's energy is listed as partial
OVER_BUDGET = 2.0        # round-toward-zero has twice round-to-nearest's unit roundoff


@dataclass
class Cause:
    """A named likely cause with the evidence for it."""

    name: str        # short identifier, e.g. "row_shift", "missing_zero_point_term"
    detail: str      # one readable sentence with the numbers
    confirmed: bool  # True when a simulation of this bug reproduces the output within the gate
    ulp_sized: bool = False  # the bug's size is a few ulps of a scale (simulate.Hyp.ulp_sized)
    residual: float = math.nan  # confirmed: the simulation's worst |out - simulated| in gates

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}" + (" [simulation reproduces the output]" if self.confirmed else "")


@dataclass
class Context:
    """Everything the diagnosis may re-simulate. Tensors are float64 CPU [M, N] unless noted."""

    out: torch.Tensor
    ref: torch.Tensor         # quantization-aware reference
    gate: torch.Tensor        # implementation gate
    x: object                 # original x [M, K] (float) or None
    w: object                 # original w [N, K] or None
    xq: object                # QTensor or plain tensor (what the reference used)
    wq: object
    bias: object = None
    orig_ref: torch.Tensor | None = None   # x @ w.T (+ bias) of the original inputs
    quant_gate: torch.Tensor | None = None  # deterministic quantization gate + implementation gate
    accumulator: str = "fp32"               # what the kernel promised
    out_dtype: torch.dtype = torch.float32  # the output rounding


def concentration(bad: torch.Tensor, dim: int) -> tuple[float, list[int]]:
    """Share of failing elements that lie in the worst 10% of rows (dim=1) or columns (dim=0),
    and those indices (at most 8)."""
    per = bad.sum(dim=dim).double()
    total = float(per.sum())
    if total == 0:
        return 0.0, []
    k = max(1, per.numel() // 10)
    top = torch.topk(per, k)
    idx = [int(i) for i, v in zip(top.indices, top.values) if v > 0][:8]
    return float(top.values.sum()) / total, idx


def _wrap_hypothesis(ctx: Context) -> Cause | None:
    """int8 wrap: one code stored as q -/+ 256 makes an output row (an x code) or column (a w code)
    wrong by -/+256 * s * (the other side's row). Recover the single element from the worst row /
    column by projection, then check its size is 256 steps. Evidence, not an exact simulation (the
    kernel's stale scale is unknown)."""
    e = ctx.out - ctx.ref
    if not torch.isfinite(e).all():
        return None
    for side, qt, oth in (("x", ctx.xq, ctx.wq), ("w", ctx.wq, ctx.xq)):
        if not _q(qt) or qt.scheme.fmt.kind != "int" or qt.scheme.fmt.bits != 8:
            continue
        o = as_operand(oth, "other").dequantized()
        ev = e if side == "x" else e.T
        i = int(ev.abs().amax(dim=1).argmax())
        row = ev[i]
        nrm = (o * o).sum(dim=0)
        proj = (row @ o) / nrm.clamp(min=1e-300)
        gain = proj * proj * nrm
        k = int(gain.argmax())
        frac = float(gain[k] / (row @ row).clamp(min=1e-300))
        op = as_operand(qt, side)
        step = float(op.scale[i, k // op.group])
        ratio = float(proj[k]) / step if step > 0 else 0.0
        if frac > 0.9 and abs(abs(ratio) - 256) < 0.15 * 256:
            return Cause("int8_wrap", f"{side}[{i}, {k}] is off by {ratio:+.0f} quantization steps (a code that "
                         f"rounded past 127 stored in int8 wraps by 256: clamp after rounding; a stale static "
                         f"scale?); this one element explains {frac:.0%} of {'row' if side == 'x' else 'column'} "
                         f"{i}'s error", False)
    return None


def _confirmed_causes(ctx: Context, sim: hy.Sim) -> tuple[list[Cause], list[tuple[float, Cause]], str]:
    """(confirmed causes, closest first and merged where they coincide; partial (share, cause);
    kind of the first confirmed)."""
    hits, partial = [], []
    for h in hy.all_hypotheses(sim):
        ok, share, worst = hy.explained(ctx.out, ctx.ref, h.pred, h.gate, h.mask)
        if ok and not h.exact:
            partial.append((math.inf, h))      # consistent, not reproduced: listed first among the partials
        elif ok:
            hits.append((worst, h))
        elif share >= PARTIAL:
            partial.append((share, h))
    # Hypotheses come most specific first; coinciding simulations join the earliest one's group,
    # then the groups (which predict different outputs) are ranked by their residual.
    groups: list[list] = []
    for worst, h in hits:
        for g in groups:
            lead = g[0][1]
            both = _common_mask(lead.mask, h.mask)
            if hy.explained(lead.pred, lead.pred, h.pred, torch.maximum(lead.gate, h.gate), both)[0]:
                g.append((worst, h))
                break
        else:
            groups.append([(worst, h)])
    if any(not g[0][1].general for g in groups):   # a fitted family adds nothing to a specific match
        groups = [g for g in groups if not g[0][1].general]
    groups.sort(key=lambda g: g[0][0])
    causes = []
    for g in groups:
        worst, h = g[0]
        others = sorted({x.name for _, x in g[1:] if not x.general} - {h.name})
        same = f"; equally explained here by: {', '.join(others)}" if others else ""
        causes.append(Cause(h.name, f"{h.detail} (worst residual {worst:.2f} of the gate{same})", True,
                            h.ulp_sized, worst))
    kind = "logic"
    if groups:
        kind = groups[0][0][1].kind
    best = {}
    for share, h in sorted(partial, key=lambda t: -t[0]):
        best.setdefault(h.name, (share, h))
    parts = [(s, Cause(h.name, f"{h.detail}: explains {s:.0%} of the error, not all of it" if h.exact else
                       f"{h.detail}: consistent with the output within a bound (a random process is simulated by "
                       f"its mean, never reproduced; a quantizer with another scale rule errs by about as much)",
                       False)) for s, h in best.values()]
    return causes, parts, kind


def _common_mask(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a & b


def _evidence(ctx: Context, err: torch.Tensor, bad: torch.Tensor) -> str:
    """One paragraph: size, sign, rows/columns, K blocks and output-proportionality of the error."""
    fin = torch.isfinite(err)
    e = torch.where(fin, err, torch.zeros_like(err))
    ref = ctx.ref
    worst = float(torch.nan_to_num(err.abs() / ctx.gate, nan=math.inf).max())
    rel = float(torch.linalg.vector_norm(e) / max(float(torch.linalg.vector_norm(ref)), 1e-300))
    parts = [f"worst error {worst:.3g}x the gate, relative L2 {rel:.2e}, {float(bad.double().mean()):.0%} of "
             f"outputs over the gate"]
    if not bool(fin.all()):
        parts.append(f"{int((~fin).sum())} non-finite outputs")
    nz = e[e != 0]
    if nz.numel():
        same = float(((torch.sign(e) == torch.sign(ref)) & (e != 0)).double().sum() / nz.numel())
        parts.append(f"{same:.0%} of nonzero errors share the output's sign")
    M, N = e.shape
    rs, rows = concentration(bad, 1)
    cs, cols = concentration(bad, 0)
    parts.append(f"worst 10% of rows hold {rs:.0%} of failures (rows {rows}), worst 10% of columns {cs:.0%} "
                 f"(columns {cols})")
    den = float((ref * ref).sum())
    en = float((e * e).sum())
    if den > 0 and en > 0:
        c = float((e * ref).sum()) / den
        glob = (c * c * den) / en
        rr = (e * ref).sum(1) / (ref * ref).sum(1).clamp(min=1e-300)
        row_fit = float(((rr[:, None] * ref) ** 2).sum()) / en
        cc = (e * ref).sum(0) / (ref * ref).sum(0).clamp(min=1e-300)
        col_fit = float(((cc[None, :] * ref) ** 2).sum()) / en
        parts.append(f"error = c x output explains {glob:.0%} (c = {c:.3g}); one factor per row {row_fit:.0%}, "
                     f"per column {col_fit:.0%} (high: a scale is wrong)")
    kb = _k_block_fit(ctx, e)
    if kb:
        parts.append(kb)
    return "; ".join(parts)


def _k_block_fit(ctx: Context, e: torch.Tensor) -> str:
    """Fit the error as sum_j c_j * (the reference's contribution of K block j); name the blocks
    whose contribution is off (c_j far from 0) when the fit explains most of the error."""
    try:
        X = as_operand(ctx.xq, "x").dequantized()
        W = as_operand(ctx.wq, "w").dequantized()
    except ValueError:
        return ""
    K = X.shape[1]
    rows, cols = accmod.sample_index(X.shape[0]), accmod.sample_index(W.shape[0])
    width = 32 if K > 32 else K
    nb = -(-K // width)
    if nb < 2 or nb * 2 > len(rows) * len(cols):
        return ""
    A = torch.stack([(X[rows, j * width:(j + 1) * width] @ W[cols, j * width:(j + 1) * width].T).reshape(-1)
                     for j in range(nb)], dim=1)
    y = e[rows][:, cols].reshape(-1)
    yn = float((y * y).sum())
    if yn == 0:
        return ""
    c = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    fit = 1 - float(((A @ c - y) ** 2).sum()) / yn
    if fit < 0.9:
        return ""
    off = [(j, float(c[j])) for j in range(nb) if abs(float(c[j])) > 0.25]
    if not off:
        return ""
    desc = ", ".join(f"K {j * width}..{min(K, (j + 1) * width) - 1} x{1 + v:.2g}" for j, v in off[:6])
    return (f"the error is {fit:.0%} explained by some {width}-wide K blocks counted the wrong number of "
            f"times: {desc}{' ...' if len(off) > 6 else ''}")


SMALL_WORK = 1 << 26     # multiply-adds per matmul below which one thread is faster than a team
SAMPLE_WORK = 1 << 28    # above this many multiply-adds the hypotheses run on sampled rows/columns
SAMPLE_ROWS, SAMPLE_COLS = 64, 256


def _take(q, idx: torch.Tensor):
    """Rows idx of an operand (QTensor or tensor), or None when its scales are shared by blocks of
    rows (a 128x128 block grid cannot be cut row by row)."""
    if not _q(q):
        return torch.as_tensor(q)[idx]
    R = q.codes.shape[0]
    rows = lambda t: None if t is None else (t[idx] if t.shape[0] == R else t)  # noqa: E731
    if q.scale.shape[0] not in (1, R):
        return None
    import dataclasses
    return dataclasses.replace(q, codes=q.codes[idx], scale=rows(q.scale), zero_point=rows(q.zero_point),
                               scale_codes=rows(q.scale_codes), shape=(len(idx),) + tuple(q.shape[1:]))


def subsample(ctx: Context) -> tuple[Context, str]:
    """The context on at most SAMPLE_ROWS rows and SAMPLE_COLS columns (evenly spaced, the first and
    last included) when simulating every hypothesis at full size would cost more than SAMPLE_WORK
    multiply-adds per simulation; a side whose scales span several rows is not cut."""
    M, N = ctx.out.shape
    K = torch.as_tensor(ctx.x).shape[-1] if ctx.x is not None else 1
    if M * N * K <= SAMPLE_WORK:
        return ctx, ""
    rows, cols = accmod.sample_index(M, SAMPLE_ROWS), accmod.sample_index(N, SAMPLE_COLS)
    xq, wq = _take(ctx.xq, rows), _take(ctx.wq, cols)
    if xq is None:
        rows, xq = torch.arange(M), ctx.xq
    if wq is None:
        cols, wq = torch.arange(N), ctx.wq
    if len(rows) == M and len(cols) == N:
        return ctx, ""
    cut = lambda t: None if t is None else t[rows][:, cols]  # noqa: E731
    sub = Context(out=cut(ctx.out), ref=cut(ctx.ref), gate=cut(ctx.gate),
                  x=None if ctx.x is None else torch.as_tensor(ctx.x)[rows],
                  w=None if ctx.w is None else torch.as_tensor(ctx.w)[cols], xq=xq, wq=wq,
                  bias=None if ctx.bias is None else torch.as_tensor(ctx.bias)[cols],
                  orig_ref=cut(ctx.orig_ref), quant_gate=cut(ctx.quant_gate), accumulator=ctx.accumulator,
                  out_dtype=ctx.out_dtype)
    return sub, f"simulated on {len(rows)} of {M} rows and {len(cols)} of {N} columns"


def _accumulator_sized(confirmed: list[Cause]) -> bool:
    """Whether every confirmed bug is the size of a few ulps of a scale (Hyp.ulp_sized: the fitted
    factors, a per-row scale replaced by one value when the rows' scales are alike, rounded scales):
    on same-sign data they coincide with a truncating accumulator's shrinkage. Only Hopper's fp8
    accumulator (fp8 operands) is preferred to them: it is known to truncate like this (the H200's
    cuBLAS does); a bf16 or fp16 accumulator claimed for int8 or wider operands would be a guess."""
    return all(c.ulp_sized for c in confirmed)


CLOSER = 0.5   # an accumulator preferred to fitted bugs reproduces the output this much more closely


def _closer_than_fits(accumulator: Cause, confirmed: list[Cause]) -> bool:
    """Whether an accumulator simulation (no fitted value) reproduces the output at most CLOSER
    times the worst residual of every confirmed bug. With few outputs (a GEMV's handful of columns)
    a one-value fit (an offset, a factor) lands within the gate of any small error, an fp16
    accumulator's included, but only the real mechanism lands well inside it."""
    return accumulator.confirmed and all(accumulator.residual <= CLOSER * c.residual for c in confirmed)


def _accumulator_cause(ctx: Context) -> tuple[Cause | None, str | None]:
    """(accumulator_narrower_than_promised, the accumulator) when a simulated narrower accumulator
    reproduces the output (exact) or its error has the same size and spread (consistent)."""
    matches = accmod.match_accumulators(ctx.out, ctx.ref, ctx.gate, ctx.xq, ctx.wq, ctx.bias, ctx.accumulator)
    for m in sorted(matches, key=lambda m: not m.exact):
        if m.exact or m.consistent:
            return Cause("accumulator_narrower_than_promised",
                         f"{m.describe()}, although {ctx.accumulator} was promised: {accmod.NARROW_ADVICE}",
                         m.exact, residual=m.residual), m.accumulator
    return None, None


def diagnose(ctx: Context) -> tuple[str, list[Cause]]:
    """(kind, causes): kind is "ok" | "numerical" | "logic"; causes most specific first.

    The diagnosis runs dozens of small float64 matmuls; below SMALL_WORK each one is done on one
    thread (a thread team's start-up dominates them, and costs 100x on a loaded machine)."""
    M, N = ctx.out.shape
    K = torch.as_tensor(ctx.x).shape[-1] if ctx.x is not None else 1
    before = torch.get_num_threads()
    if M * N * K < SMALL_WORK:
        torch.set_num_threads(1)
    try:
        return _diagnose(ctx)
    finally:
        torch.set_num_threads(before)


def _nonfinite_first(ctx: Context, found: nonfinite.Finding) -> tuple[str, list[Cause]]:
    """The non-finite outputs' cause first, then the finite outputs diagnosed on their own (the
    non-finite ones taken as right): a NaN hides every other finding, e.g. cuBLAS's fp8 accumulator
    beside torchao's NaN rows on the H200."""
    if not found.confirmed:
        # a catalogued bug whose exact simulation makes these very NaN / Inf (codes decoded with a
        # format that has Inf, ...) is where they start: it is named instead
        sub, note = subsample(ctx)
        confirmed, _, kind = _confirmed_causes(sub, hy.Sim(sub))
        if confirmed:
            return kind, confirmed
    first = Cause(found.name, found.detail, found.confirmed)
    kind, rest = _diagnose(dataclasses.replace(ctx, out=torch.where(found.mask, ctx.ref, ctx.out)))
    if kind == "ok":
        return found.kind, [first]
    for c in rest:
        c.detail = f"on the finite outputs: {c.detail}"
    return ("logic" if "logic" in (found.kind, kind) else "numerical"), [first] + rest


def _sum_magnitude(ctx: Context) -> torch.Tensor:
    """sum_k |x_q||w_q| [M, N]: the largest a partial sum can get, for overflow."""
    X = as_operand(ctx.xq, "x").dequantized().abs()
    W = as_operand(ctx.wq, "w").dequantized().abs()
    return X @ W.T


def _diagnose(ctx: Context) -> tuple[str, list[Cause]]:
    err = ctx.out - ctx.ref
    bad = ~(err.abs() <= ctx.gate)
    if not bool(bad.any()):
        return "ok", []
    if not bool(torch.isfinite(ctx.out).all()):
        found = nonfinite.explain(ctx.out, ctx.ref, ctx.xq, ctx.wq, ctx.x, ctx.w, T=_sum_magnitude(ctx),
                                  out_dtype=ctx.out_dtype, accumulator=ctx.accumulator)
        return _nonfinite_first(ctx, found)
    sub, note = subsample(ctx)
    confirmed, partial, kind = _confirmed_causes(sub, hy.Sim(sub))
    M, N = ctx.out.shape
    row_share, rows = concentration(bad, 1)
    col_share, cols = concentration(bad, 0)
    few_rows = M >= 10 and row_share > 0.9 and len(rows) < M / 5
    few_cols = N >= 10 and col_share > 0.9 and len(cols) < N / 5
    accumulator, acc_name = None, None
    if not confirmed or _accumulator_sized(confirmed):
        accumulator, acc_name = _accumulator_cause(ctx)
        if (few_rows or few_cols) and accumulator is not None and not accumulator.confirmed:
            # failures in a few lines only match an accumulator by size, not by pattern: a
            # narrow accumulator is claimed there only when its simulation reproduces every output
            accumulator, acc_name = None, None
    if confirmed:
        if note:
            confirmed[0].detail += f" ({note})"
        # (accumulator is only simulated beside confirmed bugs when they are all ulp-sized)
        if accumulator is not None and acc_name == "fp8_fast":
            # Same-sign sums through a truncating accumulator shrink every output by about one
            # factor: a constant or rounded scale of that size is simulated as well as the
            # accumulator. Both are named; the accumulator first, since its simulation needs no
            # fitted value (the measured cuBLAS fp8 GEMMs on the H200 are such a case).
            names = ", ".join(c.name for c in confirmed)
            accumulator.detail += (f"; on these inputs a logic bug of the same size is simulated as well ({names}: "
                                   f"see below); inputs of mixed sign tell them apart")
            return "numerical", [accumulator] + confirmed
        if accumulator is not None and _closer_than_fits(accumulator, confirmed):
            names = ", ".join(f"{c.name} {c.residual:.2f}" for c in confirmed)
            accumulator.detail += (f"; it reproduces the output more closely (worst residual {accumulator.residual:.2f} "
                                   f"of the gate) than the ulp-sized bugs fitted to these outputs ({names}: see "
                                   f"below)")
            return "numerical", [accumulator] + confirmed
        return kind, confirmed
    # a random process consistent with the output (stochastic rounding) competes with an accumulator
    # whose error merely has the right size: neither is claimed then, both are listed
    random_fit = any(s == math.inf for s, _ in partial)
    if accumulator is not None and (accumulator.confirmed or not random_fit):
        return "numerical", [accumulator]
    if accumulator is not None:
        partial.append((math.inf, accumulator))
    causes: list[Cause] = []
    if ctx.orig_ref is not None and ctx.quant_gate is not None and not (few_rows or few_cols):
        d_orig = float(torch.linalg.vector_norm(ctx.out - ctx.orig_ref))
        d_ref = float(torch.linalg.vector_norm(err))
        if d_orig < 0.5 * d_ref and bool(((ctx.out - ctx.orig_ref).abs() <= ctx.quant_gate).all()):
            return "logic", [Cause("different_quantization",
                                   f"the output is closer to x @ w.T of the unquantized inputs ({d_orig:.3g} "
                                   f"L2) than to this scheme's quantization ({d_ref:.3g}): the kernel quantizes "
                                   f"differently (scales, rounding or granularity) or not at all", False)]
    worst = float(torch.nan_to_num(err.abs() / ctx.gate, nan=math.inf).max())
    if worst <= OVER_BUDGET and not (few_rows or few_cols):
        return "numerical", [Cause("over_budget_evenly",
                                   f"errors exceed the derived bound by at most {worst:.2f}x in "
                                   f"{float(bad.double().mean()):.1%} of outputs without a row/column pattern "
                                   f"(an extra rounding step, or rounding toward zero somewhere)", False)]
    causes.insert(0, Cause("unexplained_logic_error", "no simulated bug reproduces the output; evidence: "
                           + _evidence(ctx, err, bad), False))
    if few_rows:
        causes.append(Cause("error_in_few_rows", f"{row_share:.0%} of failing elements lie in rows {rows}: "
                                                 f"row indexing or one row's scale", False))
    if few_cols:
        causes.append(Cause("error_in_few_columns", f"{col_share:.0%} of failing elements lie in columns {cols}: "
                                                    f"column indexing or one column's scale", False))
    wrap = _wrap_hypothesis(ctx)
    if wrap is not None:
        causes.append(wrap)
    causes.extend(c for _, c in sorted(partial, key=lambda t: -t[0]))
    return "logic", causes
