"""Quantizer bugs, each simulated from the ORIGINAL inputs: codes rounded by another rule than
round-to-nearest-even (truncation, ties away from zero, stochastic rounding), and codes cast to
their storage type without a clamp (wrapped past qmax instead of saturated).

Every edit re-runs lowbit.quantize's element step (x / s in float32, IEEE division, with the
scheme's own scales and zero points) with one rule changed, so the edited codes differ from the
reference's only where the rule does. Stochastic rounding is the one statistical hypothesis: its
output is random, so it is simulated by its mean and a derived bound on its deviation, and listed
(as consistent, never as reproduced: a quantizer on another grid errs by about as much) only when
the kernel's error has the size that rounding gives (not round-to-nearest's, half of it).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from lowbit.formats import decode, encode
from lowbit.ops.reference import as_operand
from lowbit.quantize import reduce_amax
from lowbit.verify.simulate import Hyp, Sim, _side, sides

# Stochastic rounding is named when mean(err^2 / var) lies within [1/SR_BAND, SR_BAND]: its
# expectation is 1 under stochastic rounding, ~1/2 under round-to-nearest (E[min(f, 1-f)^2] = 1/12
# against E[f(1-f)] = 1/6 for a uniform fraction f) and ~2 under truncation (E[f^2] = 1/3).
SR_BAND = math.sqrt(2.0)
# ... and only over at least SR_MIN_OUTPUTS outputs: the mean of n (nearly independent) chi^2_1
# values has standard deviation sqrt(2 / n), and the band's narrower half-width 1 - 1/sqrt(2)
# = 0.29 must be >= 5 of them: n >= 2 * (5 / 0.29)^2 = 595.
SR_MIN_OUTPUTS = 600
# Hoeffding with a union bound over the outputs: a sum of independent terms of ranges r_k leaves
# its mean by more than t = sqrt(sum r_k^2 * ln(2 n / SR_ALPHA) / 2) with probability <= SR_ALPHA.
SR_ALPHA = 1e-9


def _original(sim: Sim, side: str, qt) -> torch.Tensor | None:
    """The side's original input, float32 on the CPU; None when it is unknown or its shape is not
    the codes' (padding)."""
    orig = sim.ctx.x if side == "x" else sim.ctx.w
    if orig is None:
        return None
    xf = torch.as_tensor(orig).detach().cpu().to(torch.float32)
    return xf if tuple(xf.shape) == tuple(qt.codes.shape) else None


def _scaled(sim: Sim, side: str, qt) -> torch.Tensor | None:
    """x / s as lowbit.quantize computes it (float32 inputs, float32 expanded scales), as float64
    [R, K]; None when the original input is not known (_original)."""
    xf = _original(sim, side, qt)
    return None if xf is None else (xf / qt.expanded_scale().float()).double()


def _grid(fmt) -> torch.Tensor:
    """The finite non-negative values of a float format, sorted, float64."""
    v = decode(torch.arange(1 << fmt.bits, dtype=torch.int64).to(torch.uint8), fmt).double()
    return torch.unique(v[torch.isfinite(v) & (v >= 0)])


def _neighbours(qt, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, v') around scaled values v [R, K]: the representable element values (zero point
    included for ints) just below and above v' = v clamped into the format's range (equal where v'
    is representable), float64."""
    fmt = qt.scheme.fmt
    if fmt.kind == "int":
        z = qt.expanded_zero_point()
        if z is None:
            vc = v.clamp(-fmt.qmax, fmt.qmax)
        else:
            vc = (v + z.double()).clamp(fmt.qmin, fmt.qmax)
        return torch.floor(vc), torch.ceil(vc), vc
    g = _grid(fmt)
    a = v.abs().clamp(max=float(g[-1]))
    i = (torch.searchsorted(g, a, right=True) - 1).clamp(min=0)
    lo = g[i]
    hi = torch.where(lo < a, g[(i + 1).clamp(max=g.numel() - 1)], lo)
    sgn = torch.where(v < 0, -1.0, 1.0).double()
    lo_s, hi_s = sgn * lo, sgn * hi              # lo_s is the neighbour toward zero
    return torch.minimum(lo_s, hi_s), torch.maximum(lo_s, hi_s), sgn * a


def _codes(qt, vals: torch.Tensor):
    """Codes (qt.codes' dtype) of representable element values [R, K] (zero point included)."""
    fmt = qt.scheme.fmt
    if fmt.kind == "int":
        return vals.round().to(qt.codes.dtype)
    if fmt.policy == "fnuz":
        vals = torch.where(vals == 0, torch.zeros_like(vals), vals)   # fnuz has no -0 (its 0x80 is NaN)
    return encode(vals, fmt).to(qt.codes.dtype).reshape(qt.codes.shape)


def _rule_codes(qt, v: torch.Tensor, rule: str):
    lo, hi, vc = _neighbours(qt, v)
    fmt = qt.scheme.fmt
    zero = qt.expanded_zero_point().double() if fmt.kind == "int" and qt.zero_point is not None else 0.0
    toward_zero_lo = (vc - zero) >= 0            # for positive values the lower neighbour is toward zero
    if rule == "trunc":
        vals = torch.where(toward_zero_lo, lo, hi)
    else:                                        # ties away from zero
        mid = (lo + hi) / 2
        up = (vc > mid) | ((vc == mid) & toward_zero_lo)
        vals = torch.where(up, hi, lo)
    return _codes(qt, vals)


RULES = {"trunc": ("quantizer_truncates", "codes truncated toward zero instead of rounded to nearest even "
                   "(an int() / a float-to-int cast where a round belongs)"),
         "away": ("quantizer_rounds_half_away", "ties rounded away from zero (C's round(), std::round, "
                  "floor(x + 0.5)) instead of to even")}


def rounding_rule_hypotheses(sim: Sim):
    """Codes rounded by the wrong rule, on one side or on both (one quantizer for both)."""
    per_side = {}
    for side, _other, qt in sides(sim):
        v = _scaled(sim, side, qt)
        if v is None:
            continue
        for rule in RULES:
            codes = _rule_codes(qt, v, rule)
            if not torch.equal(codes, qt.codes):
                per_side.setdefault(rule, {})[side] = dataclasses.replace(qt, codes=codes)
    for rule, edits in per_side.items():
        name, what = RULES[rule]
        for side, edit in edits.items():
            yield sim.hyp(name, f"{_side(side)}' {what}", side, edit)
        if len(edits) == 2:
            X, W = as_operand(edits["x"], "x").dequantized(), as_operand(edits["w"], "w").dequantized()
            yield Hyp(name, f"both sides' {what}", *sim.linear(X=X, W=W))


def stochastic_rounding_hypotheses(sim: Sim):
    """Codes rounded stochastically (down or up with probabilities by distance) where the scheme
    says round-to-nearest-even, on one side or both: simulated by the mean output and a Hoeffding
    bound on the deviation; named only when the kernel's error has stochastic rounding's size."""
    n_out = sim.M * sim.N
    if n_out < SR_MIN_OUTPUTS:
        return
    moments = {}
    for side, _other, qt in sides(sim):
        v = _scaled(sim, side, qt)
        if v is None:
            continue
        lo, hi, vc = _neighbours(qt, v)
        if bool((hi == lo).all()):
            continue
        s = qt.expanded_scale().double()
        zero = qt.expanded_zero_point().double() if qt.scheme.fmt.kind == "int" and qt.zero_point is not None else 0.0
        mean = (vc - zero) * s                         # E[dequantized element]
        var = (hi - vc) * (vc - lo) * s * s            # Bernoulli variance of the step
        rng2 = ((hi - lo) * s) ** 2                    # squared range of the element
        moments[side] = (mean, var, rng2)
    combos = [(s,) for s in moments] + ([("x", "w")] if len(moments) == 2 else [])
    for combo in combos:
        X = moments["x"][0] if "x" in combo else sim.deq("x")
        W = moments["w"][0] if "w" in combo else sim.deq("w")
        pred, gate = sim.linear(X=X, W=W)
        var = torch.zeros_like(pred)
        r2 = torch.zeros_like(pred)
        if "x" in combo:
            var += moments["x"][1] @ (W * W).T
            r2 += moments["x"][2] @ (W * W).T
        if "w" in combo:
            var += (X * X) @ moments["w"][1].T
            r2 += (X * X) @ moments["w"][2].T
        if len(combo) == 2:                            # the product of the two deviations
            var += moments["x"][1] @ moments["w"][1].T
            r2 += moments["x"][2] @ moments["w"][2].T
        live = var > 0
        if int(live.sum()) < SR_MIN_OUTPUTS:
            continue
        e = sim.ctx.out - pred
        if not bool(torch.isfinite(e).all()):
            continue
        ratio = float((e[live] ** 2 / var[live]).mean())
        if not 1.0 / SR_BAND <= ratio <= SR_BAND:
            continue
        t = torch.sqrt(r2 * math.log(2 * n_out / SR_ALPHA) / 2)
        who = " and ".join(_side(s) for s in combo)
        yield Hyp("stochastic_rounding", f"{who}' codes rounded stochastically instead of to nearest even "
                  f"(the error is {ratio:.2f}x stochastic rounding's expected variance; round-to-nearest gives "
                  f"~0.5x, truncation ~2x)", pred, gate + t, general=True, exact=False)


def wrapped_code_hypotheses(sim: Sim):
    """Integer codes cast to their storage type without a clamp, so a value past qmax wraps to the
    other end (128 -> -128 in int8): with the scheme's own scales (where an asymmetric zero point or
    the rounding carries a code past the range), and with the classic divisor 2^(bits-1) in place
    of qmax (scale = amax / 128 for int8), which sends every row's largest value to -128."""
    for side, _other, qt in sides(sim):
        fmt = qt.scheme.fmt
        xf = _original(sim, side, qt) if fmt.kind == "int" else None
        if xf is None:
            continue
        span = 1 << fmt.bits
        base = -(span // 2) if fmt.signed else 0

        def wrap(q):
            return _wrap(q, fmt).to(qt.codes.dtype)

        z = qt.expanded_zero_point()
        q = torch.round(xf / qt.expanded_scale()) + (0 if z is None else z)
        lo, hi = (fmt.qmin, fmt.qmax) if z is not None else (-fmt.qmax, fmt.qmax)
        if bool(((q > hi) | (q < lo)).any()):
            yield sim.hyp("codes_wrapped_not_clamped", f"{_side(side)}' codes past the range stored without a "
                          f"clamp (they wrap by {span}: clamp after rounding)", side,
                          dataclasses.replace(qt, codes=wrap(q)))
        if qt.zero_point is None and qt.scheme.scale_format == "fp32" and fmt.signed:
            amax = reduce_amax(xf, qt.scheme)
            s2 = torch.where(amax > 0, amax / float(fmt.qmax + 1), torch.ones_like(amax))
            edit = dataclasses.replace(qt, scale=s2.contiguous())
            q2 = torch.round(xf / edit.expanded_scale())
            if bool((q2 > fmt.qmax).any()):
                yield sim.hyp("codes_wrapped_not_clamped", f"{_side(side)}' scales amax / {fmt.qmax + 1} (not / "
                              f"{fmt.qmax}) and codes stored without a clamp: the largest value of each "
                              f"{'row' if qt.scheme.strategy != 'group' else 'group'} rounds to {fmt.qmax + 1} "
                              f"and wraps to {base}", side, dataclasses.replace(edit, codes=wrap(q2)))


WRAP_CANDIDATES = 16     # a line's largest values tried as the wrapped ones (a few wrap in practice)


def _wrap(q: torch.Tensor, fmt) -> torch.Tensor:
    """q stored in the format's bits without a clamp: two's complement wraps by 2^bits."""
    span = 1 << fmt.bits
    base = -(span // 2) if fmt.signed else 0
    return torch.remainder(q - base, span) + base


def _refit(s: float, xf: torch.Tensor, O: torch.Tensor, Y: torch.Tensor, fmt) -> tuple[float, torch.Tensor]:
    """(scale, wrapped codes): the scale s of lines xf [R, K] refitted by least squares so that
    s * wrap(round(xf / s)) @ O.T matches the kernel's lines Y [R, C]; a float32 scale, as kernels
    keep it (rounding the fit recovers it exactly when the fit is within half its ulp)."""
    for _ in range(4):
        q = _wrap(torch.round(xf / torch.tensor(s, dtype=torch.float32)), fmt)
        A = q.double() @ O.T
        den = float((A * A).sum())
        if den == 0:
            break
        s = float(torch.tensor(float((Y * A).sum()) / den, dtype=torch.float32))
        if s <= 0:
            break
    return s, _wrap(torch.round(xf / torch.tensor(s, dtype=torch.float32)), fmt)


WRAP_SCAN_COLS = 64        # output columns the search compares (the scale's least squares uses all of them)
WRAP_CHUNK = 1 << 14       # intervals whose outputs are held at once (memory: CHUNK x SCAN_COLS)


def _first_fit(xr: torch.Tensor, Or: torch.Tensor, yr: torch.Tensor, gr: torch.Tensor,
               fmt) -> tuple[float, torch.Tensor] | None:
    """(float32 scale, wrapped codes [K] float64) of one line xr [K] (float32) whose kernel output
    yr [C] (gate gr [C]) has between 1 and WRAP_CANDIDATES of its largest values wrapped, each once;
    None when no scale or several code vectors reproduce the line.

    That premise bounds the scale to [lo, hi], and round(x / s) is constant between the breakpoints
    |x_k| / (m + 0.5), so s * wrap(round(x / s)) @ O.T is linear in s on each interval between them:
    every interval is tried with its least-squares scale (kept inside it) on WRAP_SCAN_COLS columns,
    and the closest one's codes are returned with their least-squares scale on all columns. A grid
    of scales can miss the right interval (~1e-4 of s wide at K = 64) and settle in a neighbour."""
    K = xr.numel()
    n = min(WRAP_CANDIDATES, K - 1)
    a = xr.double().abs()
    if n < 1 or float(a.max()) == 0 or Or.shape[0] < 2:     # one output: some scale fits any error
        return None
    # x_k wraps once s <= a_k / edge_k (its code leaves [qmin, qmax]: -qmin = qmax + 1 still fits
    # for a negative x), and wraps twice once its code passes 2^bits more
    edge = torch.where(xr > 0, fmt.qmax + 0.5, 0.5 - fmt.qmin).double()
    onset = torch.sort(a / edge, descending=True).values
    hi = float(onset[0])
    lo = max(float(onset[n]), float((a / (edge + (1 << fmt.bits))).max()))
    # the breakpoints in [lo, hi], by falling s: x_k's |code| steps from m to m + 1 at a_k / (m + 0.5),
    # from its code at hi on
    q0 = torch.round(xr.double() / hi)
    first = q0.abs().long()
    count = (torch.ceil(a / lo - 0.5).long() - first).clamp(min=0)
    k = torch.repeat_interleave(torch.arange(K), count)
    m = first[k] + torch.arange(k.numel()) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    b, order = torch.sort(a[k] / (m.double() + 0.5), descending=True)
    k, m = k[order], m[order]
    sgn = torch.sign(xr.double())[k]
    step = _wrap(sgn * (m + 1), fmt) - _wrap(sgn * m, fmt)        # +-1, or -+(2^bits - 1) at the wrap
    upper = torch.cat((torch.tensor([hi], dtype=torch.float64), b))   # interval j: [lower_j, upper_j]
    lower = torch.cat((b, torch.tensor([lo], dtype=torch.float64)))

    cols = torch.linspace(0, Or.shape[0] - 1, min(WRAP_SCAN_COLS, Or.shape[0])).round().long()
    Oc, yc, gc = Or[cols], yr[cols], gr[cols]

    def closest(A: torch.Tensor, j0: int) -> tuple[float, int, int]:
        """(squared residual, index) of the closest of intervals j0 .. j0 + len(A) - 1 (A [n, C']:
        their codes @ Oc.T), and how many of them reproduce the columns within the gate."""
        j = torch.arange(j0, j0 + A.shape[0])
        AA = (A * A).sum(dim=1)
        s = torch.where(AA > 0, (A @ yc) / AA.clamp(min=torch.finfo(torch.float64).tiny), upper[j])
        r = yc[None, :] - torch.minimum(torch.maximum(s, lower[j]), upper[j])[:, None] * A
        res = (r * r).sum(dim=1)
        i = int(res.argmin())
        return float(res[i]), j0 + i, int((r.abs() <= gc).all(dim=1).sum())

    q0 = _wrap(q0, fmt)
    A = (q0 @ Oc.T)[None, :]                                      # interval 0
    found = [closest(A, 0)]
    for c0 in range(0, k.numel(), WRAP_CHUNK):                    # intervals c0 + 1 .. c0 + CHUNK
        A = A[-1] + torch.cumsum(step[c0:c0 + WRAP_CHUNK, None] * Oc[:, k[c0:c0 + WRAP_CHUNK]].T, dim=0)
        found.append(closest(A, c0 + 1))
    # with fewer independent outputs than code vectors to tell apart (one output column: any
    # interval whose scale reaches the output) the scale is not determined by the line
    if sum(f[2] for f in found) > 1:
        return None
    best = min(found)[1]
    # the codes are returned, not re-rounded at the fitted scale: a scale a float32 ulp off the
    # kernel's would flip a code that lies within that ulp of a breakpoint
    q = q0.clone().index_add_(0, k[:best], step[:best])
    Aq = q @ Or.T
    den = float(Aq @ Aq)
    s = float(torch.tensor(float(yr @ Aq) / den, dtype=torch.float32)) if den > 0 else 0.0
    return (s, q) if s > 0 else None


def stale_scale_wrap_hypotheses(sim: Sim):
    """Integer codes made with a scale smaller than the scheme's amax / qmax (a static scale
    calibrated on a narrower range, an amax taken over part of the row) and stored without a
    clamp: the values past qmax * s wrap by 2^bits (an activation 5% over a calibrated range rounds
    to 133 and is stored as -123). The kernel's scale is unknown, so it is fitted per line (token,
    or output channel of w: _first_fit tries every code vector that wraps a few of the line's
    largest values); one scale for all lines when the scheme has one (tensor-wise: fitted on the
    worst line, refitted on all). Lines within the gate keep the reference's codes. Named only when
    each fitted line has one code vector that reproduces it, the fitted codes wrap, and the
    simulation reproduces every output within the gate."""
    if not bool(torch.isfinite(sim.ctx.out).all()):
        return
    bias = 0.0 if sim.bias is None else sim.bias[None, :]
    for side, other, qt in sides(sim):
        fmt = qt.scheme.fmt
        if fmt.kind != "int" or not fmt.signed or qt.zero_point is not None or qt.scheme.scale_format != "fp32":
            continue
        xf = _original(sim, side, qt)
        R = qt.codes.shape[0]
        if xf is None or qt.scale.shape[1] != 1 or qt.scale.shape[0] not in (1, R):
            continue
        O = sim.deq(other)
        Y = sim.ctx.out - bias
        E = Y - (sim.ctx.ref - bias)
        G = sim.ctx.gate
        bad = ~(E.abs() <= G)
        if side == "w":
            Y, E, G, bad = Y.T, E.T, G.T, bad.T
        lines = bad.any(dim=1).nonzero().flatten().tolist()
        if not lines:
            continue
        scale, codes = qt.scale.clone(), qt.codes.clone()
        if qt.scale.shape[0] == 1:              # one scale for every line: fitted on the worst, refitted on all
            worst = int(E.abs().amax(dim=1).argmax())
            fit = _first_fit(xf[worst], O, Y[worst], G[worst], fmt)
            if fit is None:
                continue
            s, q = _refit(fit[0], xf, O, Y, fmt)
            scale[:] = s
            codes = q.to(codes.dtype)
        else:
            fits = {r: _first_fit(xf[r], O, Y[r], G[r], fmt) for r in lines}
            if any(fit is None for fit in fits.values()):
                continue
            for r, (s, q) in fits.items():
                scale[r], codes[r] = s, q.to(codes.dtype)
        unclamped = torch.round(xf / scale.float())
        wrapped = _wrap(unclamped, fmt) != unclamped    # a code the store changes (qmin = -qmax - 1 is kept)
        if not bool(wrapped.any()):
            continue
        ratio = (scale.double() / qt.scale.double()).flatten()[lines if qt.scale.shape[0] > 1 else [0]]
        where = wrapped.any(dim=1).nonzero().flatten().tolist()
        yield sim.hyp("codes_wrapped_not_clamped",
                      f"{_side(side)}' codes past [{fmt.qmin}, {fmt.qmax}] stored without a clamp (they wrap by "
                      f"{1 << fmt.bits}) under a scale smaller than amax / {fmt.qmax} (fitted: "
                      f"{float(ratio.min()):.3g}..{float(ratio.max()):.3g} of it; a static scale calibrated on a "
                      f"narrower range, or an amax over part of the {'row' if side == 'x' else 'channel'}?): "
                      f"{int(wrapped.sum())} codes wrapped in {'rows' if side == 'x' else 'rows of w'} "
                      f"{where[:8]}{' ...' if len(where) > 8 else ''}; clamp after rounding", side,
                      dataclasses.replace(qt, codes=codes, scale=scale.contiguous()))


def _rule_side(sim: Sim, side: str, qt, divisor: float, recip: bool):
    """The side re-quantized with scale amax / divisor (float32, per the scheme's blocks), codes
    round-half-even of x / s (or x * (1 / s)) clamped to the storage range [qmin, qmax]; None when
    that is the reference's own quantization or the side cannot be re-quantized."""
    fmt = qt.scheme.fmt
    if fmt.kind != "int" or not fmt.signed or qt.zero_point is not None or qt.scheme.scale_format != "fp32":
        return None
    xf = _original(sim, side, qt)
    if xf is None:
        return None
    amax = reduce_amax(xf, qt.scheme)
    s = torch.where(amax > 0, amax / divisor, torch.ones_like(amax)).contiguous()
    edit = dataclasses.replace(qt, scale=s)
    se = edit.expanded_scale()
    v = xf * (1.0 / se) if recip else xf / se
    codes = torch.round(v).clamp(fmt.qmin, fmt.qmax).to(qt.codes.dtype)
    if torch.equal(codes, qt.codes) and torch.equal(s, qt.scale):
        return None
    return dataclasses.replace(edit, codes=codes)


def scale_rule_hypotheses(sim: Sim):
    """A symmetric integer quantizer with another scale rule than the scheme's amax / qmax, codes
    over the full storage range: amax / ((qmax - qmin) / 2) = amax / 127.5 for int8 (torchao's
    choose_qparams_affine SYMMETRIC, which multiplies by 1 / scale), or amax / (qmax + 1); on one
    side, or on both (one quantizer for both)."""
    qts = {side: qt for side, _other, qt in sides(sim)}
    ints = [qt.scheme.fmt for qt in qts.values() if qt.scheme.fmt.kind == "int" and qt.scheme.fmt.signed]
    if not ints:
        return
    fmt = ints[0]
    rules = [((fmt.qmax - fmt.qmin) / 2, True, "x * (1 / s)"), ((fmt.qmax - fmt.qmin) / 2, False, "x / s"),
             (float(fmt.qmax + 1), False, "x / s")]
    for divisor, recip, how in rules:
        edits = {}
        for side, qt in qts.items():
            q = qt.scheme.fmt
            if q.kind == "int" and q.signed and q.bits == fmt.bits:
                e = _rule_side(sim, side, qt, divisor, recip)
                if e is not None:
                    edits[side] = e
        what = (f"scale amax / {divisor:g} (not / {fmt.qmax}) and codes round({how}) over the full range "
                f"[{fmt.qmin}, {fmt.qmax}]{' (torchao choose_qparams_affine SYMMETRIC)' if recip else ''}: the "
                f"kernel's quantizer is not the declared scheme's (declare a scheme with its rule, or quantize "
                f"as the scheme says)")
        for side, e in edits.items():
            yield sim.hyp("scale_rule_differs", f"{_side(side)}' {what}", side, e)
        if len(edits) == 2:
            X, W = as_operand(edits["x"], "x").dequantized(), as_operand(edits["w"], "w").dequantized()
            yield Hyp("scale_rule_differs", f"both sides' {what}", *sim.linear(X=X, W=W))
