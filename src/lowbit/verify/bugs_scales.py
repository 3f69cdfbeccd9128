"""Scale bugs, each simulated exactly: a scale missing, applied twice, inverted, broadcast from row
0, taken from the other side, off by a binade, read with the wrong group size / block grid / byte
order, hoisted out of the K loop, replaced by one value, on the wrong axis, or one scale for all."""
from __future__ import annotations

import dataclasses

import torch

import lowbit as lb
from lowbit.ops.reference import as_operand, expand_rows
from lowbit.verify.simulate import Hyp, Sim, _q, _rescale, _side, _unit_scale, sides

GROUPS = (16, 32, 64, 128, 256)      # group sizes a kernel may hard-code


def _alike(s: torch.Tensor, one: torch.Tensor) -> bool:
    """Whether scales s all lie within a bf16 rounding (2^-9) of `one` (broadcast): a bug that puts
    one scale in their place is then ulp-sized (Hyp.ulp_sized, like scales_rounded) -- on same-sign
    data with one amax per row everywhere (the audit's long-K case) it reproduces a truncating
    accumulator's shrinkage, and without this it outranked the accumulator for ~3% of such inputs."""
    return float((s.double() / one.double() - 1).abs().max()) <= 2.0 ** -9


def scale_value_hypotheses(sim: Sim):
    """A scale missing, applied twice, divided instead of multiplied, broadcast from row 0
    (a stride-0 load), the other side's scale used, an e8m0 exponent off by one.
    (meta-pytorch/tritonbench#1145: a scale applied in the wrong direction and then again.)"""
    for side, other, qt in sides(sim):
        s = qt.scale
        what = _side(side)
        yield sim.hyp("scale_missing", f"{what}' scales never applied (the output is off by 1/scale)",
                      side, _rescale(qt, _unit_scale(qt)))
        yield sim.hyp("scale_applied_twice", f"{what}' scales applied twice (once when dequantizing, "
                      f"once in the epilogue)", side, _rescale(qt, s * s))
        yield sim.hyp("scale_inverted", f"{what} divided by their scales instead of multiplied "
                      f"(a quantization scale used as a dequantization scale)", side, _rescale(qt, 1.0 / s))
        for dt, nm in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            r = s.to(dt).float()
            if not torch.equal(r, s) and bool(torch.isfinite(r).all()) and bool((r > 0).all()):
                yield sim.hyp("scales_rounded", f"{what}' float32 scales stored as {nm} (rounded: every "
                              f"channel off by its own factor of up to 1 +- 2^-{9 if nm == 'bf16' else 12})",
                              side, _rescale(qt, r), ulp_sized=True)
        R = s.shape[0]
        if R > 1 and qt.scheme.strategy != "tensor":
            yield sim.hyp("scale_broadcast_stride0",
                          f"{what}: row 0's scales used for every {'token' if side == 'x' else 'output channel'} "
                          f"(a scale pointer loaded with stride 0)", side, _rescale(qt, s[:1].expand_as(s)),
                          ulp_sized=_alike(s, s[:1]))
        oq = sim.ctx.wq if side == "x" else sim.ctx.xq
        if _q(oq) and oq.scale.ndim == 2:
            os_ = oq.scale
            if os_.numel() == 1 or tuple(os_.shape) == tuple(s.shape):
                yield sim.hyp("other_sides_scale", f"{what} multiplied by the {_side(other)}' scale "
                              f"instead of their own (scale arguments swapped)",
                              side, _rescale(qt, os_.expand_as(s) if os_.numel() == 1 else os_))
        if qt.scheme.scale_format == "e8m0":
            for f, word in ((2.0, "one too large"), (0.5, "one too small")):
                yield sim.hyp("e8m0_exponent_off_by_one", f"{what}' e8m0 scale exponents {word} "
                              f"(bias 127 vs 126/128, or a rounding rule off by one binade)",
                              side, _rescale(qt, s * f))


def scale_layout_hypotheses(sim: Sim):
    """Scales read with the wrong group size, a transposed block-scale grid, a scale hoisted out of
    the K loop. (pytorch/pytorch#195751: the 1x128 scale column advanced every tile instead of every
    128/BLOCK_K tiles, and a square 128x128 scale grid read transposed; mlc-ai/TIRx-kernels#5:
    every K block given the first block's scale.)"""
    for side, other, qt in sides(sim):
        K = qt.codes.shape[-1]
        s = qt.scale
        Rs, G = s.shape
        what = _side(side)
        if G > 1:
            for gi, where in ((0, "first"), (G - 1, "last")):
                yield sim.hyp("scale_hoisted_out_of_k_loop",
                              f"{what}' per-K-block scales replaced by the {where} block's scale for every "
                              f"block (the scale load sits outside the K loop)", side,
                              _rescale(qt, s[:, gi:gi + 1].expand(Rs, G)))
            g = K // G
            flat = s.reshape(-1)
            for g2 in sorted(set(GROUPS + (g // 2, 2 * g)) - {g}):
                if g2 < 1 or g2 >= K or K % g2:
                    continue
                idx = torch.arange(K) // g2                        # the group the kernel thinks k is in
                full = torch.arange(Rs)[:, None] * G + idx[None, :]  # row-major scale storage, stride G
                oob = full >= flat.numel()
                per_k = torch.where(oob, torch.zeros((), dtype=s.dtype), flat[full.clamp(max=flat.numel() - 1)])
                edit = _rescale(qt, per_k)
                if qt.zero_point is not None:   # zero points stay where they were: one per true group
                    edit = dataclasses.replace(edit, zero_point=qt.zero_point.repeat_interleave(g, dim=1))
                h = sim.hyp("wrong_group_size", f"{what}' scales read as if one scale covered {g2} K elements "
                            f"instead of {g} (scale index k // {g2})", side, edit)
                if h is not None and bool(oob.any()):
                    bad_rows = oob.any(dim=1)                      # those rows read past the scales
                    keep = ~_rows_of(bad_rows, qt, side == "x", sim)
                    h.mask = keep
                    if not bool(keep.any()):
                        continue
                yield h
        if Rs == G and Rs > 1:
            yield sim.hyp("scale_grid_transposed", f"{what}' [{Rs}, {G}] scale grid read transposed "
                          f"(square grids hide it from shape checks)", side, _rescale(qt, s.T))
        elif Rs > 1 and G > 1:
            # a non-square grid read with the other layout's strides: element (r, g) fetched from
            # flat index g * Rs + r (the reader thinks it is stored [G, Rs]), or a [G, Rs] grid
            # (the writer transposed it) read as [Rs, G]
            yield sim.hyp("scale_grid_transposed", f"{what}' [{Rs}, {G}] scales read as if stored "
                          f"[{G}, {Rs}] (transposed strides)", side, _rescale(qt, s.reshape(G, Rs).T))
            yield sim.hyp("scale_grid_transposed", f"{what}' scales stored transposed ([{G}, {Rs}]) and "
                          f"read as [{Rs}, {G}]", side, _rescale(qt, s.T.reshape(Rs, G)))


def both_sides_hoisted(sim: Sim):
    """Both sides' per-K-block scales hoisted together (one loop, one bug)."""
    xq, wq = sim.ctx.xq, sim.ctx.wq
    if not (_q(xq) and _q(wq) and xq.scale.ndim == 2 and wq.scale.ndim == 2
            and xq.scale.shape[1] == wq.scale.shape[1] > 1):
        return
    G = xq.scale.shape[1]
    for gi, where in ((0, "first"), (G - 1, "last")):
        hx = _rescale(xq, xq.scale[:, gi:gi + 1].expand_as(xq.scale))
        hw = _rescale(wq, wq.scale[:, gi:gi + 1].expand_as(wq.scale))
        X, W = as_operand(hx, "x").dequantized(), as_operand(hw, "w").dequantized()
        yield Hyp("scale_hoisted_out_of_k_loop", f"both sides' per-K-block scales replaced by the {where} "
                  f"block's for every block (the scale load sits outside the K loop)", *sim.linear(X=X, W=W))


def _rows_of(scale_rows_bad: torch.Tensor, qt, is_x: bool, sim: Sim) -> torch.Tensor:
    """Output positions [M, N] that depend on the given scale rows of side qt."""
    R = qt.codes.shape[0]
    bad = expand_rows(scale_rows_bad[:, None].double(), R, qt.scheme, "mask")[:, 0] > 0
    full = torch.zeros(sim.M, sim.N, dtype=torch.bool)
    if is_x:
        full[bad] = True
    else:
        full[:, bad] = True
    return full


def silent_fallback_hypotheses(sim: Sim):
    """One scale for a whole tensor instead of per channel / group (pytorch/ao#2253: per-row
    scaling broken, a global scale used, unnoticed because the test data hid it)."""
    ctx = sim.ctx
    for side, other, qt in sides(sim):
        if qt.scheme.strategy == "tensor" or ctx.x is None or ctx.w is None:
            continue
        try:
            sch = dataclasses.replace(qt.scheme, strategy="tensor", group_size=None, block_size=None,
                                      scale_format="fp32", scale_rounding=None)
            alt = lb.quantize(torch.as_tensor(ctx.w if side == "w" else ctx.x), sch)
        except (ValueError, TypeError):
            continue
        yield sim.hyp("silent_per_tensor_fallback",
                      f"{_side(side)} quantized with ONE scale instead of {qt.scheme.strategy} scales", side, alt,
                      ulp_sized=_alike(qt.scale, alt.scale))


def scale_permutation_hypotheses(sim: Sim):
    """One side's per-row scale vector read at the wrong indices (a permuted, reversed or shifted
    scale vector): the index each output line uses is found from the line's ratio to the
    reference, then the edited scales are simulated exactly."""
    ctx = sim.ctx
    b = 0 if sim.bias is None else sim.bias
    base = ctx.ref - b
    y = ctx.out - b
    if not bool(torch.isfinite(y).all()):
        return
    for side, _other, qt in sides(sim):
        s = qt.scale
        if s.shape[1] != 1 or s.shape[0] < 2 or qt.scheme.strategy == "tensor":
            continue
        dim = 1 if side == "x" else 0          # x's scales act on output rows, w's on columns
        num, den = (y * base).sum(dim), (base * base).sum(dim)
        if s.shape[0] != num.numel() or not bool((den > 0).all()):
            continue
        sv = s[:, 0].double()
        want = num / den * sv                  # the scale each line seems to use
        p = (want[:, None] - sv[None, :]).abs().argmin(dim=1)
        p = torch.where(sv[p] == sv, torch.arange(sv.numel()), p)   # equal scales: keep the line's own
        moved = (p != torch.arange(sv.numel())).nonzero().flatten().tolist()
        if not moved:
            continue
        line = "row" if side == "x" else "column"
        yield sim.hyp("scales_permuted", f"{_side(side)}' per-{'token' if side == 'x' else 'channel'} scales "
                      f"read at the wrong indices ({len(moved)} of {sv.numel()} {line}s, e.g. {line} {moved[0]} "
                      f"uses the scale of {line} {int(p[moved[0]])}): a permuted or shifted scale vector",
                      side, _rescale(qt, s[p]), ulp_sized=_alike(s[p], s))


def scale_axis_hypotheses(sim: Sim):
    """Per-channel scales indexed by the wrong output axis."""
    M, N = sim.M, sim.N
    ref, ctx = sim.ctx.ref, sim.ctx
    for side, qt, n_other in (("w", ctx.wq, M), ("x", ctx.xq, N)):
        if _q(qt) and qt.scale.ndim == 2 and qt.scale.shape[1] == 1 and qt.scale.shape[0] > 1 \
                and n_other <= qt.scale.shape[0]:
            s = qt.scale[:, 0].double()
            f = (s[:M, None] / s[None, :]) if side == "w" else (s[None, :N] / s[:, None])
            yield Hyp("scales_on_wrong_axis",
                      f"{_side(side)}' per-channel scales indexed by the {'row' if side == 'w' else 'column'} "
                      f"of the output instead of the {'column' if side == 'w' else 'row'}", ref * f, ctx.gate * f)


def constant_scale_hypotheses(sim: Sim):
    """One side's per-row scales replaced by a single value the kernel got from somewhere else (a
    per-tensor scale passed to a rowwise kernel): out = ref * c / s[row]; c fitted by least squares,
    then the simulation must still match within the gate everywhere."""
    ctx = sim.ctx
    for side, other, qt in sides(sim):
        s = qt.scale
        if s.shape[1] != 1 or s.shape[0] < 2 or qt.scheme.strategy == "tensor":
            continue
        s = s[:, 0].double()
        base = ctx.ref if sim.bias is None else ctx.ref - sim.bias
        f = (1.0 / s)[:, None] if side == "x" else (1.0 / s)[None, :]
        u = base * f                                           # the output with this side's scale 1
        den = float((u * u).sum())
        if den == 0:
            continue
        y = ctx.out - (0 if sim.bias is None else sim.bias)
        c = float((u * y).sum()) / den
        pred = c * u + (0 if sim.bias is None else sim.bias)
        T = (sim.deq("x").abs() @ sim.deq("w").abs().T) * abs(c) * f.abs()
        if sim.bias is not None:
            T = T + sim.bias.abs()
        yield Hyp("scale_replaced_by_constant", f"{_side(side)}' per-{'token' if side == 'x' else 'channel'} "
                  f"scales replaced by one value {c:.6g} (a per-tensor scale given to a per-row kernel)",
                  pred, sim.gate(T, pred), general=True, ulp_sized=True)


def constant_factor_hypothesis(sim: Sim):
    """Every output off by one factor c (fitted): some scale is wrong by c, which side's the output
    cannot tell (one row, or per-tensor scales). The most general scale hypothesis: last."""
    ctx = sim.ctx
    b = 0 if sim.bias is None else sim.bias
    u = ctx.ref - b
    den = float((u * u).sum())
    if den == 0:
        return
    c = float((u * (ctx.out - b)).sum()) / den
    pred = c * u + b
    T = (sim.deq("x").abs() @ sim.deq("w").abs().T) * abs(c) + (0 if sim.bias is None else sim.bias.abs())
    yield Hyp("output_off_by_constant_factor", f"every output is {c:.6g}x what it should be: a scale (x's or "
              f"w's, one value for all) is off by that factor", pred, sim.gate(T, pred), general=True,
              ulp_sized=True)


def mx_layout_hypotheses(sim: Sim):
    """MX scale bytes packed 4 per uint32 word: byte order reversed, group-major words read in
    row-major order and the reverse."""
    for side, other, qt in sides(sim):
        R, G = qt.scale.shape
        for name, (ri, gi) in word_permutations(G, R).items():
            yield sim.hyp(name, f"{_side(side)}' packed scale bytes read in the wrong order",
                          side, _rescale(qt, qt.scale[ri, gi]))


def word_permutations(G: int, R: int):
    """Index maps for scales [R, G] packed 4 per uint32 word: byte order reversed within each word,
    and group-major words read in row-major order (and the reverse).
    Returns {name: (row_index [R, G], group_index [R, G])}."""
    if G < 4:
        return {}
    g = torch.arange(G)
    full = (G // 4) * 4
    rows = torch.arange(R)[:, None].expand(R, G)
    swapped = torch.where(g < full, 4 * (g // 4) + 3 - g % 4, g)
    perms = {"mx_scale_byte_order": (rows, swapped[None, :].expand(R, G))}
    G4 = G // 4
    if G4 >= 2 and G % 4 == 0:
        r, w4 = rows, (g // 4)[None, :].expand(R, G)
        b = (g % 4)[None, :].expand(R, G)
        i = r * G4 + w4                 # word a row-major reader fetches ...
        perms["scale_words_group_major_read_row_major"] = (i % R, 4 * (i // R) + b)  # ... from group-major storage
        i = w4 * R + r
        perms["scale_words_row_major_read_group_major"] = (i // G4, 4 * (i % G4) + b)
    return perms


