"""Simulate the accumulators a GEMM kernel may really use, on the reference's own products.

A worst-case bound (gamma_K(u) * sum|x||w|) says what a narrow accumulator CAN do; at K >= 256 an
fp16 bound is so wide that almost any wrong output fits it, so fitting it proves nothing. Here a
narrow accumulator is judged by what it DOES: the same decoded elements and scales the reference
uses are summed again with the accumulator's rounding after every step, in the summation orders
kernels use (one product at a time, one 16/32-wide MMA step at a time, fp32 inside each scale
block with the block partials accumulated narrowly, split-K partials summed in fp32), and the
kernel's error is compared with the simulated one in size and spread.

Accumulators simulated (unit roundoff u; "trunc" = rounding toward zero, whose error is up to 2u):
- fp16 (u = 2^-11), bf16 (u = 2^-8): round to nearest even after every addition; besides the orders
  used to size an error statistically, orders used only to reproduce an output exactly: each product
  rounded before it is added (no FMA), a pairwise reduction tree, K-tile partials added into the
  running sum, and those on elements dequantized first (a half-precision GEMM of dequantized values);
- fp32 (u = 2^-24): for kernels that promise an exact int32 accumulation;
- fp8_fast: Hopper's fp8 tensor-core accumulator (DeepSeek-V3 report §3.3, deepseek-ai/DeepSeek-V3#750;
  NVIDIA/cutlass#1329). Measured on an H200 (scripts/gpu_fastaccum_probe.py,
  benchmarks/results/fastaccum_probe_h200.npz, docs/diagnosis.md): each 32-wide MMA step aligns its 32
  products and the running accumulator to the largest exponent among them, keeps 13 fraction bits below it
  (14 significant bits; the rest truncated toward zero) and adds them exactly. This reproduces
  torch._scaled_mm(use_fast_accum=True) bit for bit at K = 4096 (512 of 512 same-sign outputs; 99.4% of
  mixed-sign ones) and its loss of 6.9% of a same-sign sum. Without fast accumulation cuBLAS promotes the
  partial into an fp32 accumulator every 128 K elements (the same step, restarted from zero): simulated
  loss 1.07e-4 of a same-sign sum at every K, measured 1.22e-4. At K = 16384 cuBLAS splits K (~6 slices,
  partials in fp32).
Accumulators measured by `lowbit probe` (verify/probe.py) join the fp8 orders via use_probe_table.
Shapes: out/ref [M, N] float64; the simulation runs on at most SAMPLE rows x SAMPLE columns.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lowbit.ops.reference import as_operand

SAMPLE = 48                  # rows and columns simulated (evenly spaced): enough for statistics
FAST_ACC_BITS = 13           # explicit mantissa bits kept by the fp8 fast accumulator (14 significant)
# Two rms values of the same rounding process compared: RMS_FACTOR = 2 for directed vs nearest
# rounding (a truncating accumulator has twice the unit roundoff) times 2 for the spread between
# two summation orders of the same accumulator that the simulated set does not contain.
RMS_FACTOR = 4.0
# Per row / column rms over >= 8 samples: sqrt(chi^2_8 / 8) spans 0.41 .. 1.66 between its 0.5% and
# 99.5% points, a ratio of 4 between two independent draws, times RMS_FACTOR.
LINE_FACTOR = 4.0 * RMS_FACTOR
FIT_SLACK = 0.5      # half the error's energy: random roundings explain ~1/N of it per row


ROUNDINGS = {"trunc": torch.trunc, "floor": torch.floor, "nearest": torch.round}   # of each aligned term


def aligned_sum(terms: torch.Tensor, bits: int = FAST_ACC_BITS, rounding: str = "trunc") -> torch.Tensor:
    """A fused multi-term adder: the terms [..., n] (exact float64) aligned to the largest exponent
    among them, each rounded (`rounding`: toward zero, down, or to nearest even) to `bits` fraction
    bits below it, then summed exactly (float64 holds n terms of bits + 1 significant bits)."""
    top = torch.frexp(terms.abs().amax(dim=-1)).exponent - 1          # floor(log2 max|term|)
    q = torch.ldexp(torch.ones_like(terms[..., 0]), top - bits)[..., None]   # the last bit kept
    return (ROUNDINGS[rounding](terms / q) * q).sum(dim=-1)


def aligned_step(acc: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bits: int = FAST_ACC_BITS,
                 rounding: str = "trunc") -> torch.Tensor:
    """One Hopper fp8 MMA step: acc [R, C] + x [R, k] @ w [C, k].T with the k products and acc aligned
    to the largest exponent among them and truncated to `bits` fraction bits below it, then summed
    exactly (aligned_sum)."""
    p = x[:, None, :] * w[None, :, :]                                 # [R, C, k], exact in float64
    return aligned_sum(torch.cat([acc[..., None], p], dim=-1), bits, rounding)


# Accumulators measured by `lowbit probe` (verify/probe.py) and registered by use_probe_table:
# label -> (bits, rounding, block, promote); simulated as further orders of "fp8_fast".
PROBED: dict[str, tuple[int, str, int, int]] = {}


def use_probe_table(table: dict) -> list[str]:
    """Register the fp8 paths of a `lowbit probe` table (its JSON, parsed) as simulated orders of the
    fp8_fast accumulator; returns their labels. Paths the probe could not fit are skipped."""
    labels = []
    for path, r in table.get("paths", {}).items():
        if not path.startswith(("cublas_fp8", "triton_fp8")) or not r.get("fitted"):
            continue
        label = (f"{path} as probed on {table.get('device', 'a GPU')} ({r['bits']} fraction bits, {r['rounding']}, "
                 f"{r['block']}-term steps, {'promoted every ' + str(r['promote']) + ' K' if r['promote'] else 'never promoted'})")
        PROBED[label] = (int(r["bits"]), str(r["rounding"]), int(r["block"]), int(r["promote"]))
        labels.append(label)
    return labels


def _step_fn(name: str, via_f32: bool = False):
    """One summation step of accumulator `name`: (partial, x [R, k], w [C, k]) -> the new partial.
    Hopper's fp8 tensor core aligns and truncates inside the step (aligned_step; "aligned:<bits>:
    <rounding>" for a probed one); the others round the exact step sum once."""
    if name == "fp8_fast":
        return aligned_step
    if name.startswith("aligned:"):
        _, bits, rounding = name.split(":")
        return lambda part, x, w: aligned_step(part, x, w, int(bits), rounding)
    rnd = _round_fn(name, via_f32)
    return lambda part, x, w: rnd(part + x @ w.T)


def round_half(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 t rounded ONCE (to nearest even) to fp16 / bf16, as float64. torch converts float64 to
    a half type through float32, which rounds twice; rounding to float32 by round-to-odd first keeps
    the second rounding correct (float32's 24 bits >= the half type's 11 + 2)."""
    f = t.to(torch.float32)
    back = f.double()
    inexact = back != t
    f = torch.where(inexact & (back.abs() > t.abs()), torch.nextafter(f, torch.zeros_like(f)), f)
    odd = torch.where(inexact, f.view(torch.int32) | 1, f.view(torch.int32)).view(torch.float32)
    return odd.to(dtype).to(torch.float64)


def _round_fn(name: str, via_f32: bool = False):
    """Rounding to accumulator `name` of float64 values; via_f32: fp16 / bf16 reached through float32
    (two roundings, as a kernel that sums in float32 and casts, or torch's float64 cast, does)."""
    if name in ("fp16", "bf16"):
        dt = torch.float16 if name == "fp16" else torch.bfloat16
        if via_f32:
            return lambda t: t.to(torch.float32).to(dt).to(torch.float64)
        return lambda t: round_half(t, dt)
    if name == "fp32":
        return lambda t: t.to(torch.float32).to(torch.float64)
    if name == "exact":
        return lambda t: t
    raise ValueError(f"unknown accumulator {name!r}")


@dataclass
class Order:
    """One summation order: `inner` rounds after every `chunk` products inside a scale block
    (or a `promote`-long stretch of K), `main` after adding each scaled block partial.
    product: each product is rounded to `inner` before it is added (no fused multiply-add);
    tree: the stretch is summed pairwise (a reduction tree), rounding every node to `inner`;
    dequant_first: the elements are multiplied by their scales (in fp32) and held in `inner`'s type
    before the products, as a kernel that dequantizes and then runs a half-precision GEMM does;
    exact_only: the order is used to reproduce an output, not to size an error statistically (see
    match_accumulators)."""

    label: str
    inner: str
    chunk: int
    main: str
    splits: int = 1
    promote: int = 0        # fp8 fast accumulation promoted into `main` every this many K (0: never)
    product: bool = False
    tree: bool = False
    dequant_first: bool = False
    exact_only: bool = False
    via_f32: bool = False   # fp16 / bf16 roundings through float32 (see _round_fn)


KTILES = (32, 64, 128)      # K tiles whose partials a tiled kernel adds into its running sum


def orders_for(acc: str, nb: int, both_fp8: bool, quantized: bool = False) -> list[Order]:
    """Plausible summation orders of an accumulator `acc` for a GEMM with nb scale blocks along K;
    quantized: some operand has scales (then the orders of a dequantize-first kernel are added)."""
    if acc == "fp8_fast":
        if not both_fp8:
            return []
        return [Order("fp8 fast accumulation (each 32-wide MMA step keeps 14 bits of the aligned sum, "
                      "never promoted)", "fp8_fast", 32, "exact"),
                Order("fp8 accumulation promoted to fp32 every 128 K", "fp8_fast", 32, "fp32", promote=128)] + \
            [Order(label, f"aligned:{b}:{r}", blk, "fp32" if pr else "exact", promote=pr)
             for label, (b, r, blk, pr) in PROBED.items()]
    out = [Order(f"{acc}, one product at a time", acc, 1, acc),
           Order(f"{acc}, one 16-wide MMA step at a time", acc, 16, acc),
           Order(f"{acc} partials of 4 split-K slices summed in fp32", acc, 16, acc, splits=4)]
    if nb > 1:
        out.append(Order(f"fp32 inside each scale block, block partials accumulated in {acc}", "fp32", 1, acc))
    if acc in ("fp16", "bf16"):
        extra = [Order(f"{acc}, each product rounded to {acc} and then added (no fused multiply-add)", acc, 1, acc,
                       product=True, exact_only=True),
                 Order(f"{acc}, products rounded to {acc} and summed pairwise (a reduction tree)", acc, 1, acc,
                       product=True, tree=True, exact_only=True)]
        extra += [Order(f"{acc}, {t}-wide K-tile partials (16-wide MMA steps from zero) added into a running "
                        f"{acc} sum", acc, 16, acc, promote=t, exact_only=True) for t in KTILES]
        if quantized:
            extra += [Order(o.label.replace(f"{acc},", f"{acc} on dequantized elements,", 1), o.inner, o.chunk,
                            o.main, product=o.product, tree=o.tree, dequant_first=True, exact_only=True)
                      for o in out[:2] + extra[:2]]
        out += extra
    return out


def _segments(gx: int, gw: int, K: int, promote: int):
    """K ranges on which both sides' scales (groups of gx and gw elements) are constant:
    (k0, k1, x scale col, w scale col)."""
    gc = math.gcd(gx, gw)
    segs = []
    for j in range(K // gc):
        k0 = j * gc
        step = min(promote, gc) if promote else gc   # a promoted partial is scaled on its own
        for a in range(k0, k0 + gc, step):
            segs.append((a, min(a + step, k0 + gc), k0 // gx, k0 // gw))
    return segs


def _unit(q) -> float:
    if hasattr(q, "scheme") and q.scheme.fmt.kind == "float":
        return float(q.scheme.fmt.min_subnormal)
    return 1.0


def _tree_step(rnd):
    """Pairwise sum of x [R, k] * w [C, k] with every product and every node rounded by rnd."""
    def step(part, x, w):
        p = rnd(x[:, None, :] * w[None, :, :])
        while p.shape[-1] > 1:
            if p.shape[-1] % 2:
                p = torch.cat([p, torch.zeros_like(p[..., :1])], dim=-1)
            p = rnd(p[..., 0::2] + p[..., 1::2])
        return rnd(part + p[..., 0])
    return step


def _product_step(rnd):
    """One product at a time, the product rounded before the addition (no fused multiply-add)."""
    return lambda part, x, w: rnd(part + rnd(x @ w.T))


def simulate(xq, wq, order: Order, rows: torch.Tensor, cols: torch.Tensor, bias=None) -> torch.Tensor:
    """The output [len(rows), len(cols)] float64 of a kernel summing the decoded elements of xq and
    wq (QTensor or plain tensor) in `order`, block partials times both scales in float32, + bias."""
    xo, wo = as_operand(xq, "xq"), as_operand(wq, "wq")
    ux, uw = _unit(xq), _unit(wq)
    X = xo.vals[rows] * ux                       # decoded elements, what the kernel multiplies
    W = wo.vals[cols] * uw
    SX = xo.scale[rows] / ux
    SW = wo.scale[cols] / uw
    K = X.shape[1]
    gx, gw = xo.group, wo.group
    f32 = _round_fn("fp32")
    if order.dequant_first:                      # elements times scales in fp32, held in the
        held = _round_fn(order.inner, order.via_f32)   # accumulator's type by a half-precision GEMM
        X = held(f32(X * SX.repeat_interleave(gx, dim=1)))
        W = held(f32(W * SW.repeat_interleave(gw, dim=1)))
        SX, SW = torch.ones_like(SX[:, :1]), torch.ones_like(SW[:, :1])
        gx = gw = K
    step, main = _step_fn(order.inner, order.via_f32), _round_fn(order.main, order.via_f32)
    if order.tree:
        step = _tree_step(_round_fn(order.inner, order.via_f32))
    elif order.product:
        step = _product_step(_round_fn(order.inner, order.via_f32))
    chunk = K if order.tree else order.chunk
    segs = _segments(gx, gw, K, order.promote)
    per = -(-len(segs) // order.splits)
    total = torch.zeros(X.shape[0], W.shape[0], dtype=torch.float64)
    for s0 in range(0, len(segs), per):
        acc = torch.zeros_like(total)
        for k0, k1, sx, sw in segs[s0:s0 + per]:
            part = torch.zeros_like(total)
            for a in range(k0, k1, chunk):
                b = min(a + chunk, k1)
                part = step(part, X[:, a:b], W[:, a:b])
            scaled = f32(f32(part * SX[:, sx:sx + 1]) * SW[:, sw][None, :])
            acc = main(acc + scaled)
        total = f32(total + acc) if order.splits > 1 else acc
    if bias is not None:
        total = f32(total + torch.as_tensor(bias).detach().cpu().double()[cols][None, :])
    return total


def sample_index(n: int, cap: int = SAMPLE) -> torch.Tensor:
    """Evenly spaced indices 0 .. n-1, at most `cap` of them (always the first and the last)."""
    if n <= cap:
        return torch.arange(n)
    return torch.unique(torch.linspace(0, n - 1, cap).round().long())


# what a kernel found accumulating narrower than it promised should do (check_linear, check_grouped_linear)
NARROW_ADVICE = ("accumulate in fp32 (or split K and sum the partials in fp32), or declare the accumulator the "
                 "kernel really uses")


@dataclass
class AccumulatorMatch:
    """How well a simulated accumulator explains a kernel's error on the sampled outputs."""

    accumulator: str
    order: str              # the order whose error is closest in size
    exact: bool             # some order reproduces the output within the gate
    rms_ratio: float        # rms(kernel error) / rms(simulated error) of the closest order
    consistent: bool        # size, tail and spread per row and column all match
    residual: float = math.nan  # exact: the best order's worst |out - simulation| in gates

    def describe(self) -> str:
        if self.exact:
            return f"a {self.accumulator} accumulator ({self.order}) reproduces the output"
        return (f"the error has the size and spread of a {self.accumulator} accumulator's "
                f"({self.order}: kernel rms error {self.rms_ratio:.2f}x the simulated one, no row or "
                f"column out of line)")


def _rms(t: torch.Tensor, dim=None) -> torch.Tensor:
    return torch.sqrt(torch.mean(t * t, dim=dim)) if dim is not None else torch.sqrt(torch.mean(t * t))


def candidates(promised: str, xq, wq) -> list[str]:
    """Accumulators narrower than the promised one worth simulating for these operands."""
    fp8 = all(hasattr(q, "scheme") and q.scheme.fmt.kind == "float" and q.scheme.fmt.bits == 8
              for q in (xq, wq))
    wider = {"int32": ["fp32", "fp8_fast", "bf16", "fp16"], "fp32": ["fp8_fast", "fp16", "bf16"],
             "fp8_fast": ["fp16", "bf16"], "fp16": ["bf16"], "bf16": []}
    return [a for a in wider.get(promised, []) if a != "fp8_fast" or fp8]


def match_accumulators(out: torch.Tensor, ref: torch.Tensor, gate: torch.Tensor, xq, wq, bias,
                       promised: str) -> list[AccumulatorMatch]:
    """Simulate every narrower accumulator (candidates) in every order on a sample of outputs and
    say which explain the kernel's error. out/ref/gate: float64 [M, N]."""
    M, N = out.shape
    rows, cols = sample_index(M), sample_index(N)
    o, r, g = out[rows][:, cols], ref[rows][:, cols], gate[rows][:, cols]
    e = o - r
    xo, wo = as_operand(xq, "xq"), as_operand(wq, "wq")
    K = xo.vals.shape[1]
    nb = K // math.gcd(xo.group, wo.group)
    both_fp8 = "fp8_fast" in candidates("fp32", xq, wq)
    found = []
    quantized = hasattr(xq, "scheme") or hasattr(wq, "scheme")
    for acc in candidates(promised, xq, wq):
        sims = [(od, simulate(xq, wq, od, rows, cols, bias)) for od in orders_for(acc, nb, both_fp8, quantized)]
        if not sims:
            continue
        exact = [(od, s) for od, s in sims if _same(o, s, g)]
        if not exact and acc in ("fp16", "bf16"):      # the same orders, rounding through float32
            via = [(od, simulate(xq, wq, dataclasses.replace(od, via_f32=True), rows, cols, bias)) for od, _ in sims]
            exact = [(od, s) for od, s in via if _same(o, s, g)]
        if exact:
            found.append(AccumulatorMatch(acc, exact[0][0].label, True, 1.0, True,
                                          min(_worst_residual(o, s, g) for _, s in exact)))
            continue
        if not torch.isfinite(o).all():
            continue
        es = [(od, s - r) for od, s in sims if torch.isfinite(s).all() and not od.exact_only]
        if not es:
            continue
        re = float(_rms(e))
        ratios = [(re / max(float(_rms(d)), 1e-300), od, d) for od, d in es]
        ratio, od, _ = min(ratios, key=lambda t: abs(math.log(max(t[0], 1e-300))))
        hi_rms = max(float(_rms(d)) for _, _, d in ratios)
        lo_rms = min(float(_rms(d)) for _, _, d in ratios)
        hi_max = max(float(d.abs().max()) for _, _, d in ratios)
        size_ok = lo_rms / RMS_FACTOR <= re <= hi_rms * RMS_FACTOR
        # Largest error: at most RMS_FACTOR x the largest any simulated order makes.
        tail_ok = float(e.abs().max()) <= RMS_FACTOR * hi_max
        lines_ok = True
        for dim in (0, 1):
            if e.shape[dim] >= 8:
                per = torch.stack([_rms(d, dim) for _, _, d in ratios])
                # every row / column errs about as much as the simulation says: at most LINE_FACTOR
                # more than its largest (plus the gate's own scale, for lines that barely round) and
                # at least 1/LINE_FACTOR of its smallest: a narrow accumulator leaves no line exact
                mine = _rms(e, dim)
                lines_ok &= bool((mine <= LINE_FACTOR * per.amax(dim=0) + _rms(g, dim)).all())
                lines_ok &= bool((mine >= per.amin(dim=0) / LINE_FACTOR).all())
        # rounding errors are not one factor times the output per row or column (a wrong scale
        # is): such a fit may explain at most FIT_SLACK more of the kernel's error than of the
        # simulated one (truncating accumulators do correlate with the output, and then so does
        # their simulation)
        fit_ok = _line_fit(e, r) <= max(_line_fit(d, r) for _, _, d in ratios) + FIT_SLACK
        found.append(AccumulatorMatch(acc, od.label, False, ratio, size_ok and tail_ok and lines_ok and fit_ok))
    return found


def _line_fit(e: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest share of |e|^2 explained by one factor per row, or one per column, times ref."""
    en = float((e * e).sum())
    if en == 0:
        return 0.0
    best = 0.0
    for dim in (0, 1):
        c = (e * ref).sum(dim, keepdim=True) / (ref * ref).sum(dim, keepdim=True).clamp(min=1e-300)
        best = max(best, float(((c * ref) ** 2).sum()) / en)
    return best


def _worst_residual(o: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> float:
    """Largest |o - s| in units of the gate over the finite outputs (0 where both agree exactly)."""
    f = torch.isfinite(o) & torch.isfinite(s)
    d = (o[f] - s[f]).abs()
    return float((d / g[f].clamp(min=1e-300)).max()) if d.numel() else 0.0


def _same(o: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> bool:
    fo, fs = torch.isfinite(o), torch.isfinite(s)
    if not torch.equal(fo, fs):
        return False
    if not bool((o[~fo] == s[~fs]).all()):       # the same infinities
        return False
    return bool(((o[fo] - s[fs]).abs() <= g[fo]).all())
