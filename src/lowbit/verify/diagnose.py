"""Name the likely cause of a mismatch from the error's shape (seed 002 §5.4, §7; seed 000, 004).

Three criteria, in seed 002's order:
1. magnitude: error / result ~ 1 means every element is wrong: a logic error, not rounding;
2. structure: error concentrated in some rows or columns, or explained by one rewiring of the
   inputs (a shifted row, scales on the other axis, a missing term): an indexing/logic error;
   error spread evenly and merely too large: numerical (e.g. a narrower accumulator);
3. reference swap: the error is measured against the quantization-aware float64 reference,
   and also against the original inputs; a kernel within the quantization error of the
   original inputs but off the reference implements a DIFFERENT quantization (fallback).

Structure is tested by re-simulation: each named bug is a small edit of the QTensors
(scales of another group, another row, no zero point, ...) whose exact output
qlinear_reference computes; a bug is named when its simulation explains the kernel's output.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops.reference import as_operand, qlinear_reference


@dataclass
class Cause:
    """A named likely cause with the evidence for it."""

    name: str        # short identifier, e.g. "row_shift", "missing_zero_point"
    detail: str      # one readable sentence with the numbers
    confirmed: bool  # True when a simulation of this bug reproduces the output within the gate

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
    gate_for: dict | None = None            # accumulator name -> implementation gate


def _q(t) -> bool:
    return hasattr(t, "codes") and hasattr(t, "scheme")


def _explains(ctx: Context, pred: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[bool, float]:
    """(within gate everywhere, residual norm / error norm) of a simulated output."""
    e0 = (ctx.out - ctx.ref)
    e1 = (ctx.out - pred)
    if mask is not None:
        e0, e1, g = e0[mask], e1[mask], ctx.gate[mask]
    else:
        g = ctx.gate
    n0 = torch.linalg.vector_norm(e0).item()
    n1 = torch.linalg.vector_norm(e1).item()
    ratio = n1 / n0 if n0 > 0 else math.inf
    return bool((e1.abs() <= g).all()), ratio


def _try(ctx: Context, causes: list, name: str, detail: str, pred, mask=None) -> None:
    if pred is None:
        return
    ok, ratio = _explains(ctx, pred, mask)
    if ok or ratio < 0.05:
        causes.append(Cause(name, detail + f" (residual {ratio:.1e} of the error)", ok))


def _rescale(qt, scale: torch.Tensor):
    return dataclasses.replace(qt, scale=scale.contiguous())


def _word_permutations(G: int, R: int):
    """Index maps of seed 002 pitfall 1 for scales [R, G] packed 4 per uint32 word:
    byte order reversed within each word, and group-major words read in row-major order (and
    the reverse). Returns {name: (row_index [R, G], group_index [R, G])}."""
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


def _scale_hypotheses(ctx: Context, causes: list) -> None:
    for side, other in (("w", "x"), ("x", "w")):
        qt = ctx.wq if side == "w" else ctx.xq
        if not _q(qt) or qt.scale.ndim != 2:
            continue
        R, G = qt.scale.shape
        sim = (lambda q: qlinear_reference(ctx.xq, q, ctx.bias)) if side == "w" else \
              (lambda q: qlinear_reference(q, ctx.wq, ctx.bias))
        # per-K-block scale hoisted out of the K loop (seed 002 pitfall 3): one group's scale for all
        if G > 1:
            for gi, where in ((0, "first"), (G - 1, "last")):
                s = qt.scale[:, gi:gi + 1].expand(R, G)
                _try(ctx, causes, "scale_hoisted_out_of_k_loop",
                     f"{side}'s per-K-block scales replaced by the {where} block's scale for every block",
                     sim(_rescale(qt, s)))
        # MX scale layout (seed 002 pitfall 1)
        for name, (ri, gi) in _word_permutations(G, R).items():
            if R != qt.scale.shape[0]:
                continue
            _try(ctx, causes, name, f"{side}'s packed scale bytes read in the wrong order",
                 sim(_rescale(qt, qt.scale[ri, gi])))
        # silent per-tensor fallback (seed 004 failure mode 1)
        if qt.scheme.strategy != "tensor" and ctx.x is not None and ctx.w is not None:
            import lowbit as lb
            try:  # one fp32 scale (e8m0 / two-level scale formats only exist per block)
                sch = dataclasses.replace(qt.scheme, strategy="tensor", group_size=None, block_size=None,
                                          scale_format="fp32", scale_rounding=None)
                alt = lb.quantize(torch.as_tensor(ctx.w if side == "w" else ctx.x), sch)
            except (ValueError, TypeError):
                alt = None
            if alt is not None:
                _try(ctx, causes, "silent_per_tensor_fallback",
                     f"{side} quantized with ONE scale instead of {qt.scheme.strategy} scales", sim(alt))
        # zero point dropped from the epilogue (seed 000 pitfall, seed 004 failure mode)
        if qt.zero_point is not None:
            _try(ctx, causes, "missing_zero_point_term",
                 f"{side}'s zero-point correction z * sum_k {other}_q missing: a per-"
                 f"{'row' if side == 'x' else 'column'} offset proportional to {other}'s code sums",
                 sim(dataclasses.replace(qt, zero_point=None)))
    xq, wq = ctx.xq, ctx.wq
    # both sides' per-K-block scales hoisted together (one loop, one bug)
    if _q(xq) and _q(wq) and xq.scale.ndim == 2 and wq.scale.ndim == 2 and \
            xq.scale.shape[1] == wq.scale.shape[1] > 1:
        G = xq.scale.shape[1]
        for gi, where in ((0, "first"), (G - 1, "last")):
            hx = _rescale(xq, xq.scale[:, gi:gi + 1].expand_as(xq.scale))
            hw = _rescale(wq, wq.scale[:, gi:gi + 1].expand_as(wq.scale))
            _try(ctx, causes, "scale_hoisted_out_of_k_loop",
                 f"both sides' per-K-block scales replaced by the {where} block's for every block "
                 f"(seed 002 pitfall 3: the error grows with the K-block position)",
                 qlinear_reference(hx, hw, ctx.bias))
    # per-channel scales applied along the other output axis
    M, N = ctx.out.shape
    for side, qt, n_other in (("w", wq, M), ("x", xq, N)):
        if _q(qt) and qt.scale.ndim == 2 and qt.scale.shape[1] == 1 and qt.scale.shape[0] > 1 \
                and n_other <= qt.scale.shape[0]:
            s = qt.scale[:, 0].double()
            if side == "w":
                pred = ctx.ref / s[None, :] * s[:M, None]
            else:
                pred = ctx.ref / s[:, None] * s[None, :N]
            _try(ctx, causes, "scales_on_wrong_axis",
                 f"{side}'s per-channel scales indexed by the {'row' if side == 'w' else 'column'} "
                 f"of the output instead of the {'column' if side == 'w' else 'row'}", pred)


def _shift_hypotheses(ctx: Context, causes: list) -> None:
    M, N = ctx.out.shape
    ones = torch.ones(M, N, dtype=torch.bool)
    for dim, size, what in ((0, M, "row"), (1, N, "column")):
        if size < 2:
            continue
        for step in (1, -1):
            pred = torch.roll(ctx.ref, step, dims=dim)
            mask = ones.clone()
            edge = 0 if step == 1 else size - 1
            if dim == 0:
                mask[edge] = False
            else:
                mask[:, edge] = False
            _try(ctx, causes, f"{what}_shift",
                 f"output {what} i holds the reference's {what} i{'-' if step == 1 else '+'}1 "
                 f"(an off-by-one {what} index)", pred, mask)


def _wrap_hypothesis(ctx: Context, causes: list) -> None:
    """int8 wrap (seed 000 pitfall): one code stored as q -/+ 256 makes an output row (an x code)
    or column (a w code) wrong by -/+256 * s * (the other side's row). Recover the single
    element from the worst row / column by projection, then check its size is 256 steps."""
    e = ctx.out - ctx.ref
    if not torch.isfinite(e).all():
        return
    for side, qt, oth in (("x", ctx.xq, ctx.wq), ("w", ctx.wq, ctx.xq)):
        if not _q(qt) or qt.scheme.fmt.kind != "int" or qt.scheme.fmt.bits != 8:
            continue
        o = as_operand(oth, "other").dequantized()          # [N, K] (side x) or [M, K] (side w)
        ev = e if side == "x" else e.T                      # rows of ev belong to `side`
        i = int(ev.abs().amax(dim=1).argmax())
        row = ev[i]
        nrm = (o * o).sum(dim=0)                            # [K]
        proj = (row @ o) / nrm.clamp(min=1e-300)            # best single-element error per k
        gain = proj * proj * nrm
        k = int(gain.argmax())
        frac = float(gain[k] / (row @ row).clamp(min=1e-300))
        op = as_operand(qt, side)
        step = float(op.scale[i, k // op.group])
        ratio = float(proj[k]) / step if step > 0 else 0.0
        if frac > 0.9 and abs(abs(ratio) - 256) < 0.15 * 256:
            where = f"{side}[{i}, {k}]"
            causes.append(Cause("int8_wrap",
                                f"{where} is off by {ratio:+.0f} quantization steps (a code that rounded past "
                                f"127 stored in int8 wraps by 256: clamp after rounding; stale scale?); "
                                f"this one element explains {frac:.0%} of {'row' if side == 'x' else 'column'} "
                                f"{i}'s error", False))


def _accumulator_hypothesis(ctx: Context, causes: list) -> None:
    if not ctx.gate_for:
        return
    e = (ctx.out - ctx.ref).abs()
    for name in ("fp16", "bf16"):
        g = ctx.gate_for.get(name)
        if g is not None and bool((e <= g).all()):
            frac_rows = float(((e > ctx.gate).any(dim=1)).double().mean())
            causes.append(Cause("accumulator_narrower_than_promised",
                                f"errors exceed the promised accumulator's bound in {frac_rows:.0%} of rows "
                                f"but fit a {name} accumulator's (seed 002 pitfall 2: accumulate in fp32, "
                                f"or split K and sum partials in fp32)", False))
            return


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


def diagnose(ctx: Context) -> tuple[str, list[Cause]]:
    """(kind, causes): kind is "ok" | "numerical" | "logic"."""
    err = (ctx.out - ctx.ref)
    bad = ~(err.abs() <= ctx.gate)
    if not bool(bad.any()):
        return "ok", []
    causes: list[Cause] = []
    finite = bool(torch.isfinite(ctx.out).all())
    if not finite:
        n = int((~torch.isfinite(ctx.out)).sum())
        causes.append(Cause("non_finite_output", f"{n} NaN/Inf outputs (overflow of a narrow accumulator "
                                                 f"or output type, or uninitialised memory)", False))
    else:
        _shift_hypotheses(ctx, causes)
        _scale_hypotheses(ctx, causes)
        _wrap_hypothesis(ctx, causes)
    rel = torch.linalg.vector_norm(err[torch.isfinite(err)]).item() / max(torch.linalg.vector_norm(ctx.ref).item(), 1e-300)
    M, N = ctx.out.shape
    row_share, rows = concentration(bad, 1)
    col_share, cols = concentration(bad, 0)
    logic = any(c.name != "accumulator_narrower_than_promised" for c in causes)
    few_rows = M >= 10 and row_share > 0.9 and len(rows) < M / 5
    few_cols = N >= 10 and col_share > 0.9 and len(cols) < N / 5
    # A narrow accumulator spreads its error over the whole output; an error confined to a
    # few rows or columns that happens to fit the fp16 bound is an indexing/scale bug instead.
    if not causes and finite and not (few_rows or few_cols):
        _accumulator_hypothesis(ctx, causes)
    if rel > 0.1:  # criterion 1: the error is of the order of the result
        causes.append(Cause("wrong_result_magnitude", f"relative L2 error {rel:.2e}: every output is wrong by "
                                                      f"a sizeable fraction of itself, not a rounding effect", False))
        logic = True
    if few_rows:  # criterion 2
        causes.append(Cause("error_in_few_rows", f"{row_share:.0%} of failing elements lie in rows {rows}: "
                                                 f"row indexing or one row's scale", False))
        logic = True
    if few_cols:
        causes.append(Cause("error_in_few_columns", f"{col_share:.0%} of failing elements lie in columns {cols}: "
                                                    f"column indexing or one column's scale", False))
        logic = True
    if ctx.orig_ref is not None and ctx.quant_gate is not None and finite and not logic:
        # criterion 3: close to the float inputs, far from the scheme's quantization
        if bool(((ctx.out - ctx.orig_ref).abs() <= ctx.quant_gate).all()) and \
                not any(c.name == "accumulator_narrower_than_promised" for c in causes):
            causes.append(Cause("different_quantization", "the output is within the quantization error of the "
                                                          "original inputs but not equal to the scheme's quantization: "
                                                          "the kernel quantizes differently (scales, rounding, "
                                                          "granularity)", False))
            logic = True
    if not causes:
        causes.append(Cause("over_budget_evenly", f"errors exceed the derived bound in {float(bad.double().mean()):.1%} "
                                                  f"of outputs without a row/column pattern", False))
    return ("logic" if logic else "numerical"), causes
