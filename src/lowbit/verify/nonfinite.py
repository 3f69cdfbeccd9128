"""Non-finite outputs from finite inputs, named where they start.

check_linear's inputs are finite and so is its reference, so every NaN / Inf a kernel returns was
made by the kernel. It is the most common real bug and it hides every other finding (a NaN fails
every gate and no simulation of a finite bug reproduces it), so it is named first and the finite
outputs are diagnosed on their own afterwards (diagnose.py).

Where a non-finite value can start, each predicted as the set of outputs it reaches (a non-finite
element of x row i reaches every output of row i through the K reduction; of w row n, column n):
- zero_block_scale_nan: a scale block whose amax is 0 given the scale 0 (no floor): its codes are
  0/0 = NaN (pytorch/ao#4713: torchao's Float8Tensor activations; huggingface/kernels-community#680);
- subnormal_scale_nonfinite: a float32 scale amax / max below float32's smallest normal 2^-126: a
  kernel that flushes subnormals to zero divides by 0 (x/0 = +-Inf, 0/0 = NaN), and 1 / scale
  overflows to Inf below 2^-128;
- scale_overflow_nonfinite: a scale past fp16's largest value 65504 where a kernel keeps scales in
  fp16: the scale is Inf, its codes x/Inf = 0 and the dequantized 0 * Inf = NaN;
- output_overflow_inf: a sum past the largest finite value of the output or accumulator type
  (certain where |reference| is past it, possible where sum |x_q| |w_q| is).
The non-finite outputs are matched against these predictions: a source is taken when every output
it predicts is non-finite; when the taken sources cover every non-finite output the pattern is
reproduced (confirmed). What remains is described by where it lies: whole rows or columns (a NaN or
Inf entered one operand's row before the reduction: a NaN code, a NaN scale, uninitialised memory)
or scattered outputs and their bounding blocks (the epilogue, a tile's store).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.quantize import reduce_amax

FP32_MIN_NORMAL = 2.0 ** -126
FP16_MAX = 65504.0
SHOWN = 8            # rows / columns / blocks listed in a message


@dataclass
class Finding:
    """What the non-finite outputs are and where they start.

    name: the cause's name; detail: one readable paragraph; confirmed: the predicted set of
    non-finite outputs is exactly the observed one; kind: "logic" (a scale with no floor, a NaN
    from nowhere) or "numerical" (a sum past a narrower type's range); mask: [M, N] bool, the
    non-finite outputs."""

    name: str
    detail: str
    confirmed: bool
    kind: str
    mask: torch.Tensor


@dataclass
class _Source:
    name: str
    kind: str
    mask: torch.Tensor            # outputs it certainly makes non-finite [M, N]
    possible: torch.Tensor        # outputs it may make non-finite (>= mask)
    what: str                     # the arithmetic, with the rows / columns / blocks


def _lines(idx: torch.Tensor) -> str:
    v = idx.flatten().tolist()
    return f"{v[:SHOWN]}{' ...' if len(v) > SHOWN else ''} ({len(v)})"


def _side_sources(side: str, qt, orig, M: int, N: int):
    """Sources in one quantized operand (side "x": its rows are output rows; "w": output columns)."""
    if not (hasattr(qt, "codes") and hasattr(qt, "scheme")) or qt.scale.ndim != 2:
        return
    R, K = qt.codes.shape
    o = None if orig is None else torch.as_tensor(orig).detach().cpu().float()
    if o is not None and tuple(o.shape) == (R, K):
        amax = reduce_amax(o, qt.scheme)
    else:
        amax = reduce_amax(qt.dequantize(torch.float32).cpu(), qt.scheme)
    Rs, G = amax.shape
    if R % Rs and qt.scheme.strategy != "block":
        return
    per = -(-R // Rs)
    fmax = float(qt.scheme.fmt.max)
    scale = amax.double() / fmax
    what_side = "activations x" if side == "x" else "weights w"
    out_lines = "output rows" if side == "x" else "output columns"
    fp32_scales = qt.scheme.scale_format == "fp32"
    tests = [("zero_block_scale_nan", amax == 0,
              "got the scale 0 (amax 0, no floor on the scale): their codes are 0/0 = NaN; floor the scale "
              "(e.g. at float32's smallest normal) or give all-zero blocks the scale 1")]
    if fp32_scales:
        tests.append(("subnormal_scale_nonfinite", (amax > 0) & (scale < FP32_MIN_NORMAL),
                      f"have a subnormal float32 scale (amax / {fmax:g} < 2^-126): flushed to zero it divides "
                      "x/0 = +-Inf, 0/0 = NaN, and 1/scale overflows below 2^-128; floor the scale at 2^-126 "
                      "or compute in a wider type"))
        tests.append(("scale_overflow_nonfinite", scale > FP16_MAX,
                      f"have a scale past fp16's 65504 (amax / {fmax:g}): a kernel keeping scales in fp16 "
                      "gets Inf, codes x/Inf = 0 and 0 * Inf = NaN; keep scales in float32"))
    for name, blocks, why in tests:
        if not bool(blocks.any()):
            continue
        rows = blocks.any(dim=1).repeat_interleave(per)[:R]                 # [R] lines fed
        mask = torch.zeros(M, N, dtype=torch.bool)
        if side == "x":
            mask[rows, :] = True
        else:
            mask[:, rows] = True
        bl = [tuple(b) for b in blocks.nonzero().tolist()]
        where = (f"scale blocks (row, group) {bl[:SHOWN]}{' ...' if len(bl) > SHOWN else ''}"
                 if G > 1 or per > 1 else f"{'rows' if side == 'x' else 'rows of w'} {_lines(rows.nonzero())}"
                 if Rs > 1 else "the one tensor-wise scale")
        yield _Source(name, "logic", mask, mask,
                      f"{what_side}: {where} {why}; they reach {out_lines} {_lines(rows.nonzero())}")


def _overflow_source(ref: torch.Tensor, T: torch.Tensor, out_dtype: torch.dtype, accumulator: str):
    """Sums past the largest finite value of the output type (certain where |ref| is past it) or
    of the accumulator (possible where sum |x_q||w_q| is: the partial sums' order decides)."""
    limits = []
    if out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        limits.append((f"the {out_dtype} output", float(torch.finfo(out_dtype).max)))
    if accumulator in ("fp16", "bf16"):
        dt = torch.float16 if accumulator == "fp16" else torch.bfloat16
        limits.append((f"the {accumulator} accumulator", float(torch.finfo(dt).max)))
    if not limits:
        return None
    big = min(v for _, v in limits)
    certain = ref.abs() > big
    possible = certain | (T > big)
    if not bool(possible.any()):
        return None
    names = " / ".join(n for n, _ in limits)
    return _Source("output_overflow_inf", "numerical", certain, possible,
                   f"sums past {big:.6g}, the largest finite value of {names}: they overflow to Inf "
                   f"({int(certain.sum())} outputs certainly, {int(possible.sum())} possibly, by the order "
                   "of the partial sums); scale the output or accumulate in float32")


def _describe(mask: torch.Tensor) -> str:
    """Where the outputs in mask lie: whole rows, whole columns, or their count and bounding box."""
    M, N = mask.shape
    rows = mask.all(dim=1)
    cols = mask.all(dim=0)
    rest = mask & ~rows[:, None] & ~cols[None, :]
    parts = []
    if bool(rows.any()) and N > 1:
        parts.append(f"every output of rows {_lines(rows.nonzero())}: a NaN or Inf entered these rows of x "
                     "before the K reduction (a NaN code, a NaN or Inf scale, uninitialised memory)")
    if bool(cols.any()) and M > 1:
        parts.append(f"every output of columns {_lines(cols.nonzero())}: a NaN or Inf entered these rows of w "
                     "before the K reduction")
    if M == 1 or N == 1:
        rest = mask
    if bool(rest.any()):
        idx = rest.nonzero()
        r0, c0 = idx.min(dim=0).values.tolist()
        r1, c1 = idx.max(dim=0).values.tolist()
        parts.append(f"{int(rest.sum())} outputs in rows {r0}..{r1}, columns {c0}..{c1} (first "
                     f"{[tuple(t) for t in idx[:4].tolist()]}): made after the reduction (the epilogue, "
                     "a tile's store, a division in the output)")
    return "; ".join(parts)


def explain(out: torch.Tensor, ref: torch.Tensor, xq, wq, x=None, w=None, *, T: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.float32, accumulator: str = "fp32") -> Finding | None:
    """The Finding for the non-finite outputs of `out` [M, N] (None when every output is finite).

    ref: the float64 reference [M, N]; xq / wq: the operands the reference used (QTensors or plain
    tensors); x / w: the original float inputs (for the scale blocks' amax); T: sum_k |x_q||w_q|
    [M, N] (the largest partial sum), for overflow."""
    bad = ~torch.isfinite(out)
    if not bool(bad.any()):
        return None
    M, N = out.shape
    nan = int(torch.isnan(out).sum())
    pinf, ninf = int((out == float("inf")).sum()), int((out == float("-inf")).sum())
    head = f"{int(bad.sum())} of {M * N} outputs are not finite ({nan} NaN, {pinf} +Inf, {ninf} -Inf) from finite inputs"
    sources = list(_side_sources("x", xq, x, M, N)) + list(_side_sources("w", wq, w, M, N))
    ov = _overflow_source(ref, T if T is not None else ref.abs(), out_dtype, accumulator)
    if ov is not None:
        sources.append(ov)
    taken, covered = [], torch.zeros_like(bad)
    for s in sources:
        # taken when every output it certainly reaches is non-finite and it may reach one that is
        if bool((s.mask & ~bad).any()) or not bool((s.possible & bad).any()):
            continue
        taken.append(s)
        covered |= s.possible & bad
    rest = bad & ~covered
    confirmed = bool(taken) and not bool(rest.any())
    if taken:
        name = taken[0].name
        kind = "numerical" if all(s.kind == "numerical" for s in taken) else "logic"
        detail = f"{head}; " + "; ".join(s.what for s in taken)
        if rest.any():
            detail += f"; not explained by a scale or a range: {_describe(rest)}"
        elif confirmed:
            detail += " (the predicted non-finite outputs are exactly the kernel's)"
        return Finding(name, detail, confirmed, kind, bad)
    return Finding("non_finite_output", f"{head}, and no zero, subnormal or overflowing scale nor a sum past the "
                   f"output's range reaches them: {_describe(bad)}", False, "logic", bad)
