"""Named kernel bugs, each simulated exactly: the output a kernel with that bug would produce.

Every hypothesis is a small edit of what the reference computes (a scale read from the wrong
place, a K range dropped, codes decoded with the wrong format, ...) whose output is computed in
float64, together with the implementation gate of the EDITED computation (a kernel with the bug
still rounds like a kernel). diagnose.py names a bug only when its simulation reproduces the
kernel's output within that gate everywhere.

Each generator takes a Sim and yields Hyp objects lazily; the ones that do not apply to the
operands (no zero point, no bias, an 8-bit format for a nibble bug, ...) yield nothing.
Real bug reports behind the hypotheses are cited next to them and in tests/test_diagnose_zoo.py.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops.reference import as_operand
from lowbit.verify import tolerance as tol

TILES = (16, 32, 64, 128, 256)      # K tile widths of common GEMM kernels
SPLITS = (2, 4)                      # split-K factors
GROUPS = (16, 32, 64, 128, 256)      # group sizes a kernel may hard-code
# Output limits a kernel may clamp or saturate to: fp16 / fp8 e4m3 / e5m2 maxima, int8.
CLAMPS = {"fp16 max (65504)": 65504.0, "fp8 e4m3 max (448)": 448.0, "fp8 e5m2 max (57344)": 57344.0,
          "int8 range (127)": 127.0}
FP8_TWINS = {"fp8_e4m3fn": ("fp8_e4m3fnuz", "fp8_e5m2"), "fp8_e4m3fnuz": ("fp8_e4m3fn",),
             "fp8_e5m2": ("fp8_e4m3fn", "fp8_e5m2fnuz"), "fp8_e5m2fnuz": ("fp8_e5m2",)}


@dataclass
class Hyp:
    """A simulated bug: its output `pred` [M, N] float64 and the gate [M, N] a kernel with the bug
    must meet; `mask` [M, N] bool limits the comparison (outputs the bug leaves undefined)."""

    name: str
    detail: str
    pred: torch.Tensor
    gate: torch.Tensor
    mask: torch.Tensor | None = None
    kind: str = "logic"           # "numerical" for precision bugs (rounded inputs)
    general: bool = False         # a fitted family that contains more specific hypotheses


def _q(t) -> bool:
    return hasattr(t, "codes") and hasattr(t, "scheme")


def _side(name: str) -> str:
    return "activations x" if name == "x" else "weights w"


class Sim:
    """Computes the output and gate of edited operands. ctx: diagnose.Context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.n, self.u = tol.rounding_count(ctx.xq, ctx.wq, ctx.accumulator, ctx.bias is not None)
        self.bias = None if ctx.bias is None else torch.as_tensor(ctx.bias).detach().cpu().double()
        self.M, self.N = ctx.out.shape
        self._d = {}

    def deq(self, side: str) -> torch.Tensor:
        """Float64 dequantized operand [R, K] of the unedited side."""
        if side not in self._d:
            self._d[side] = as_operand(self.ctx.xq if side == "x" else self.ctx.wq, side).dequantized()
        return self._d[side]

    def gate(self, T: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        return tol.gate_from_sum(T, pred, self.n, self.u, self.ctx.out_dtype)

    def linear(self, X=None, W=None, bias="keep") -> tuple[torch.Tensor, torch.Tensor]:
        """(pred, gate) of X @ W.T + bias for dequantized float64 X [M, K], W [N, K]
        (None = the unedited side)."""
        X = self.deq("x") if X is None else X
        W = self.deq("w") if W is None else W
        b = self.bias if isinstance(bias, str) else bias
        pred, T = X @ W.T, X.abs() @ W.abs().T
        if b is not None:
            pred, T = pred + b, T + b.abs()
        return pred, self.gate(T, pred)

    def with_side(self, side: str, qt) -> tuple[torch.Tensor, torch.Tensor]:
        D = as_operand(qt, side).dequantized()
        return self.linear(X=D) if side == "x" else self.linear(W=D)

    def hyp(self, name, detail, side, qt, kind="logic") -> Hyp | None:
        try:
            pred, gate = self.with_side(side, qt)
        except ValueError:          # e.g. a twin format decodes a code as NaN: not simulable here
            return None
        return Hyp(name, detail, pred, gate, kind=kind)


def _rescale(qt, scale: torch.Tensor):
    return dataclasses.replace(qt, scale=scale.contiguous())


def _unit_scale(qt) -> torch.Tensor:
    return torch.ones_like(qt.scale)


def sides(sim: Sim):
    for side, other in (("x", "w"), ("w", "x")):
        qt = sim.ctx.xq if side == "x" else sim.ctx.wq
        if _q(qt) and qt.scale.ndim == 2:
            yield side, other, qt


# ------------------------------------------------------------------------------------------
# Scales
# ------------------------------------------------------------------------------------------
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
        R = s.shape[0]
        if R > 1 and qt.scheme.strategy != "tensor":
            yield sim.hyp("scale_broadcast_stride0",
                          f"{what}: row 0's scales used for every {'token' if side == 'x' else 'output channel'} "
                          f"(a scale pointer loaded with stride 0)", side, _rescale(qt, s[:1].expand_as(s)))
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
    from lowbit.ops.reference import expand_rows
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
    import lowbit as lb
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
                      f"{_side(side)} quantized with ONE scale instead of {qt.scheme.strategy} scales", side, alt)


def scale_axis_hypotheses(sim: Sim):
    """Per-channel scales indexed by the wrong output axis."""
    M, N = sim.M, sim.N
    ref, ctx = ctx_ref(sim), sim.ctx
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
                  pred, sim.gate(T, pred), general=True)


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
              f"w's, one value for all) is off by that factor", pred, sim.gate(T, pred), general=True)


def ctx_ref(sim: Sim) -> torch.Tensor:
    return sim.ctx.ref


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


# ------------------------------------------------------------------------------------------
# Codes
# ------------------------------------------------------------------------------------------
def code_hypotheses(sim: Sim):
    """Zero point dropped or with the wrong sign; integer codes read with the wrong signedness
    (ROCm/hip-ep#178: unsigned nibbles decoded as signed, off by 8); fp8 codes decoded with a
    twin format (uccl-project/uccl#804: e4m3fnuz bytes read as e4m3fn); packed int4/fp4 nibbles
    in the wrong order (kekzl/imp#722: split halves read as interleaved pairs; amd/Quark#30)."""
    for side, other, qt in sides(sim):
        what = _side(side)
        fmt = qt.scheme.fmt
        if qt.zero_point is not None:
            yield sim.hyp("missing_zero_point_term",
                          f"{what}' zero-point correction z * sum_k {other}_q missing: a per-"
                          f"{'row' if side == 'x' else 'column'} offset proportional to the {_side(other)}' "
                          f"code sums", side, dataclasses.replace(qt, zero_point=None))
            yield sim.hyp("zero_point_wrong_sign", f"{what}' zero point added instead of subtracted",
                          side, dataclasses.replace(qt, zero_point=-qt.zero_point))
        if fmt.kind == "int":
            c = qt.codes.to(torch.int64)
            span = 1 << fmt.bits
            if fmt.signed:
                flip, word = torch.where(c < 0, c + span, c), "unsigned"
            else:
                flip, word = torch.where(c >= span // 2, c - span, c), "signed (two's complement)"
            if not torch.equal(flip, c):
                yield sim.hyp("codes_wrong_signedness", f"{what}' {fmt.bits}-bit codes read as {word} "
                              f"(off by {span} wherever the top bit is set)", side, dataclasses.replace(qt, codes=flip))
        elif fmt.bits == 8:
            for twin in FP8_TWINS.get(fmt.name, ()):
                sch = dataclasses.replace(qt.scheme, format=twin)
                from lowbit.formats import decode
                # decoded by hand: a twin format may turn a code into Inf/NaN, which the kernel
                # then propagates (the reference's operand refuses such codes)
                D = decode(qt.codes, sch.fmt).double() * qt.expanded_scale().double()
                pred, gate = sim.linear(X=D) if side == "x" else sim.linear(W=D)
                yield Hyp("fp8_format_confusion", f"{what}' {fmt.name} codes decoded as {twin} "
                          f"({'exponent bias off by one: every value halved or doubled' if twin[:7] == fmt.name[:7] else 'a different exponent/mantissa split'})",
                          pred, gate)
        if fmt.bits == 4:
            K = qt.codes.shape[1]
            for name, perm, how in _nibble_perms(K):
                yield sim.hyp("nibble_order_swapped", f"{what}' packed 4-bit codes unpacked {how}", side,
                              dataclasses.replace(qt, codes=qt.codes[:, perm]))


def _nibble_perms(K: int):
    """K-index maps of nibble-order bugs: pairs swapped (high nibble taken as the first element),
    and split halves of 32-element blocks (low nibbles = 0..15, high = 16..31) read as
    interleaved pairs, and the reverse."""
    out = []
    if K % 2 == 0:
        k = torch.arange(K)
        out.append(("pairs", k ^ 1, "with the high and low nibble swapped"))
    if K >= 32:
        k = torch.arange(K)
        full = (K // 32) * 32
        b, i = k // 32, k % 32
        split_as_inter = torch.where(k < full, 32 * b + (i // 2) + 16 * (i % 2), k)
        inter_as_split = torch.where(k < full, 32 * b + 2 * (i % 16) + i // 16, k)
        out.append(("s2i", split_as_inter, "as interleaved pairs although they are stored as split "
                                            "halves of each 32-element block"))
        out.append(("i2s", inter_as_split, "as split halves of each 32-element block although they are "
                                            "stored as interleaved pairs"))
    return out


def transpose_hypotheses(sim: Sim):
    """Weight codes read as if stored K-major ([K, N]) although they are [N, K] row-major."""
    qt = sim.ctx.wq
    if not _q(qt) or qt.codes.ndim != 2:
        return
    N, K = qt.codes.shape
    if N < 2:
        return
    idx = (torch.arange(K)[None, :] * N + torch.arange(N)[:, None]).reshape(-1)
    codes = qt.codes.reshape(-1)[idx].reshape(N, K)
    yield sim.hyp("weight_read_transposed", "weight codes read as if stored [K, N] (column-major) "
                  "although they are [N, K]: a transposed load", "w", dataclasses.replace(qt, codes=codes))


# ------------------------------------------------------------------------------------------
# K ranges, bias, output
# ------------------------------------------------------------------------------------------
def k_range_hypotheses(sim: Sim):
    """A K tail dropped when K is not a tile multiple (NVIDIA/cutlass#3536, tile-ai/tilelang#2605,
    NVIDIA/TensorRT-LLM#12835), a tile or split-K partial dropped or added twice."""
    X, W = sim.deq("x"), sim.deq("w")
    K = X.shape[1]
    ranges = {}
    for t in TILES:
        if K > t and K % t:
            ranges.setdefault((K // t * t, K), ("k_tail_dropped", f"the last {K % t} K elements "
                              f"(K = {K} is not a multiple of the {t}-wide K tile)"))
    for t in TILES:
        if K > t:
            ranges.setdefault((0, t), ("k_tile", f"the first {t}-wide K tile"))
            last = (K // t - 1) * t
            ranges.setdefault((last, last + t), ("k_tile", f"the last full {t}-wide K tile (K {last}..{last + t - 1})"))
    for s in SPLITS:
        c = -(-K // s)
        for i in range(s):
            if i * c < K:
                ranges.setdefault((i * c, min(K, (i + 1) * c)), ("k_tile", f"split-K slice {i} of {s} "
                                  f"(K {i * c}..{min(K, (i + 1) * c) - 1})"))
    ref = sim.ctx.ref
    base_T = X.abs() @ W.abs().T + (0 if sim.bias is None else sim.bias.abs())
    for (a, b), (kind, what) in ranges.items():
        C = X[:, a:b] @ W[:, a:b].T
        Tr = X[:, a:b].abs() @ W[:, a:b].abs().T
        if kind == "k_tail_dropped":
            yield Hyp("k_tail_dropped", f"{what} never accumulated", ref - C, sim.gate(base_T - Tr, ref - C))
            yield Hyp("k_tile_read_twice", f"{what} accumulated twice", ref + C, sim.gate(base_T + Tr, ref + C))
        else:
            yield Hyp("k_tile_dropped", f"{what} never accumulated (a lost tile or split-K partial)",
                      ref - C, sim.gate(base_T - Tr, ref - C))
            yield Hyp("k_tile_read_twice", f"{what} accumulated twice", ref + C, sim.gate(base_T + Tr, ref + C))


def bias_hypotheses(sim: Sim):
    """Bias missing, added twice, or added to the accumulator before the scales multiply it
    (vllm-project/vllm#31676: bias added before dequantization in a fused-MoE kernel)."""
    if sim.bias is None:
        return
    ctx, b = sim.ctx, sim.bias
    yield Hyp("bias_missing", "the bias is never added", *sim.linear(bias=None))
    yield Hyp("bias_added_twice", "the bias is added twice", *sim.linear(bias=2 * b))
    xq, wq = ctx.xq, ctx.wq
    sx = xq.scale.double() if _q(xq) and xq.scale.ndim == 2 and xq.scale.shape[1] == 1 else None
    sw = wq.scale.double() if _q(wq) and wq.scale.ndim == 2 and wq.scale.shape[1] == 1 else None
    if sx is not None or sw is not None:
        f = torch.ones(sim.M, sim.N, dtype=torch.float64)
        if sx is not None:
            f = f * sx.expand(sim.M, 1) if sx.numel() > 1 else f * sx.reshape(())
        if sw is not None:
            f = f * (sw.reshape(1, -1).expand(1, sim.N) if sw.numel() > 1 else sw.reshape(()))
        X, W = sim.deq("x"), sim.deq("w")
        bf = b[None, :] * f
        pred = X @ W.T + bf
        yield Hyp("bias_before_scales", "the bias is added to the accumulator before the scales multiply "
                  "it (it must be added after dequantization)", pred, sim.gate(X.abs() @ W.abs().T + bf.abs(), pred))


def output_hypotheses(sim: Sim):
    """Output clamped to a narrow type's range; no quantization at all (a plain x @ w.T)."""
    ctx = sim.ctx
    ref = ctx.ref
    for what, L in CLAMPS.items():
        if bool((ref.abs() > L).any()) and bool((ref.abs() > L).float().mean() < 1):
            yield Hyp("output_clamped", f"the output clamped to the {what}", ref.clamp(-L, L), ctx.gate)
    if ctx.x is not None and ctx.w is not None and (_q(ctx.xq) or _q(ctx.wq)):
        xf = torch.as_tensor(ctx.x).double()
        wf = torch.as_tensor(ctx.w).double()
        n, u = tol.rounding_count(xf, wf, "fp32", ctx.bias is not None)
        for X, W, what in ((xf, wf, "neither x nor w is quantized: the kernel computed a plain x @ w.T"),
                           (xf, None, "the activations were not quantized (a weight-only path ran)"),
                           (None, wf, "the weights were used unquantized")):
            if (X is None and not _q(ctx.xq)) or (W is None and not _q(ctx.wq)):
                continue
            Xd = X if X is not None else sim.deq("x")
            Wd = W if W is not None else sim.deq("w")
            pred, T = Xd @ Wd.T, Xd.abs() @ Wd.abs().T
            if sim.bias is not None:
                pred, T = pred + sim.bias, T + sim.bias.abs()
            gate = tol.gate_from_sum(T, pred, n, max(u, sim.u), ctx.out_dtype)
            yield Hyp("different_quantization", what, pred, gate)


def precision_hypotheses(sim: Sim):
    """An unquantized side rounded to TF32 / bf16 / fp16 before the multiply (torch's allow_tf32
    matmul, a bf16 cast on the way in): a numerical, not a logic, difference."""
    ctx = sim.ctx
    for side in ("x", "w"):
        qt = ctx.xq if side == "x" else ctx.wq
        if _q(qt):
            continue
        D = sim.deq(side)
        for name, fn in (("tf32", _tf32), ("bf16", lambda t: t.to(torch.bfloat16).double()),
                         ("fp16", lambda t: t.to(torch.float16).double())):
            R = fn(D)
            pred, gate = sim.linear(X=R) if side == "x" else sim.linear(W=R)
            yield Hyp("inputs_rounded", f"the unquantized {_side(side)} were rounded to {name} before the "
                      f"multiply (e.g. torch.backends.cuda.matmul.allow_tf32)", pred, gate, kind="numerical")


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to TF32 (10 explicit mantissa bits), nearest even, via float32 bits."""
    b = t.to(torch.float32).view(torch.int32).to(torch.int64)
    drop = 13
    half = 1 << (drop - 1)
    low = b & ((1 << drop) - 1)
    keep = b >> drop
    up = (low > half) | ((low == half) & (keep & 1 == 1))
    r = ((keep + up.to(torch.int64)) << drop).to(torch.int32)
    return r.view(torch.float32).double()


def permutation_hypotheses(sim: Sim):
    """Output rows or columns written to other rows/columns: an off-by-one index (row_shift /
    column_shift) or any other permutation, e.g. a tile swizzle undone wrongly on the store."""
    ctx = sim.ctx
    out, ref, gate = ctx.out, ctx.ref, ctx.gate
    M, N = out.shape
    ones = torch.ones(M, N, dtype=torch.bool)
    for dim, size, what in ((0, M, "row"), (1, N, "column")):
        if size < 2:
            continue
        for step in (1, -1):
            pred = torch.roll(ref, step, dims=dim)
            mask = ones.clone()
            edge = 0 if step == 1 else size - 1
            if dim == 0:
                mask[edge] = False
            else:
                mask[:, edge] = False
            yield Hyp(f"{what}_shift", f"output {what} i holds the reference's {what} "
                      f"i{'-' if step == 1 else '+'}1 (an off-by-one {what} index)",
                      pred, torch.roll(gate, step, dims=dim), mask)
        p = _match_lines(out, ref, gate, dim)
        if p is not None:
            moved = [i for i in range(size) if int(p[i]) != i]
            kind = "a permutation" if len(set(p.tolist())) == size else "with some lines duplicated"
            pred = ref[p] if dim == 0 else ref[:, p]
            g = gate[p] if dim == 0 else gate[:, p]
            yield Hyp(f"{what}s_permuted", f"output {what}s written to the wrong place ({kind}; {len(moved)} "
                      f"of {size} moved, e.g. {what} {moved[0]} holds the reference's {what} {int(p[moved[0]])}): "
                      f"a tile swizzle or store index bug", pred, g)


def _match_lines(out, ref, gate, dim: int):
    """For each output row (dim 0) / column (dim 1), the reference line it equals within the gate,
    preferring itself; None unless every line matches and some line is not itself."""
    o, r, g = (out, ref, gate) if dim == 0 else (out.T, ref.T, gate.T)
    n = o.shape[0]
    if n < 2 or n > 4096:
        return None
    p = torch.empty(n, dtype=torch.long)
    for i in range(n):
        if bool(((o[i] - r[i]).abs() <= g[i]).all()):
            p[i] = i
            continue
        fits = ((o[i][None, :] - r).abs() <= g).all(dim=1)
        hit = torch.nonzero(fits)
        if hit.numel() == 0:
            return None
        p[i] = int(hit[0])
    if bool((p == torch.arange(n)).all()):
        return None
    return p


ALL = (permutation_hypotheses, scale_value_hypotheses, scale_layout_hypotheses, both_sides_hoisted, silent_fallback_hypotheses,
       scale_axis_hypotheses, mx_layout_hypotheses, code_hypotheses, transpose_hypotheses,
       k_range_hypotheses, bias_hypotheses, output_hypotheses, precision_hypotheses,
       constant_scale_hypotheses, constant_factor_hypothesis)


def all_hypotheses(sim: Sim):
    """Every applicable hypothesis, lazily, most common bugs first."""
    for gen in ALL:
        for h in gen(sim):
            if h is not None:
                yield h


def explained(out, ref, pred, gate, mask=None) -> tuple[bool, float, float]:
    """(within gate everywhere, share of the error's energy explained, worst |out - pred| / gate).
    Non-finite outputs count as explained only where the simulation is non-finite too."""
    if mask is not None:
        out, ref, pred, gate = out[mask], ref[mask], pred[mask], gate[mask]
    fo, fp = torch.isfinite(out), torch.isfinite(pred)
    both = fo & fp
    e0, e1 = (out - ref)[both], (out - pred)[both]
    n0 = float((e0 * e0).sum())
    n1 = float((e1 * e1).sum())
    share = 1.0 - n1 / n0 if n0 > 0 else -math.inf
    if not torch.equal(fo, fp):
        return False, share if bool(fo.all()) else -math.inf, math.inf
    worst = float(torch.nan_to_num(e1.abs() / gate[both], nan=math.inf).max()) if e1.numel() else 0.0
    return worst <= 1.0, share, worst
