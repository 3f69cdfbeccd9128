"""Accumulation and output bugs, each simulated exactly: a K tail / tile / split-K slice dropped or
counted twice, the bias missing / doubled / added before the scales, the output clamped, no
quantization at all, unquantized inputs rounded to TF32 / bf16 / fp16, output rows or columns
shifted or permuted."""
from __future__ import annotations

import torch

from lowbit.verify import tolerance as tol
from lowbit.verify.simulate import Hyp, Sim, _q, _side

TILES = (16, 32, 64, 128, 256)      # K tile widths of common GEMM kernels
SPLITS = (2, 4)                      # split-K factors
# Output limits a kernel may clamp or saturate to: fp16 / fp8 e4m3 / e5m2 maxima, int8.
CLAMPS = {"fp16 max (65504)": 65504.0, "fp8 e4m3 max (448)": 448.0, "fp8 e5m2 max (57344)": 57344.0,
          "int8 range (127)": 127.0}


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




OFFSET_MIN_ROWS = 4   # a per-column offset is fitted from the rows: with fewer it absorbs any error


def offset_hypotheses(sim: Sim):
    """A constant, or one value per column, added to every output (a stray `+ 1`, an epilogue
    adding a vector the caller did not pass, a bias the check was not told about): the offset is
    fitted as the mean error, then the simulation must match within the gate everywhere."""
    ctx = sim.ctx
    e = ctx.out - ctx.ref
    if not bool(torch.isfinite(e).all()):
        return
    X, W = sim.deq("x"), sim.deq("w")
    T = X.abs() @ W.abs().T + (0 if sim.bias is None else sim.bias.abs())
    # an offset within a bf16 rounding (2^-9) of the typical output is ulp-sized (simulate.Hyp): on
    # same-sign outputs of one size a truncating accumulator's shrinkage is such an offset
    small = 2.0 ** -9 * float(ctx.ref.abs().median())
    c = float(e.mean())
    if c != 0:
        pred = ctx.ref + c
        yield Hyp("output_offset", f"every output off by the same constant {c:+.4g} (a stray addend in the "
                  f"epilogue)", pred, sim.gate(T + abs(c), pred), general=True, ulp_sized=abs(c) <= small)
    if sim.M >= OFFSET_MIN_ROWS and sim.N > 1:
        cn = e.mean(dim=0, keepdim=True)
        pred = ctx.ref + cn
        lead = ", ".join(f"{float(v):+.4g}" for v in cn[0, :4])
        yield Hyp("output_offset_per_column", f"every column off by its own constant ({lead}, ...): a vector "
                  f"added to the output that should not be (a bias the check was not told about, or the "
                  f"wrong one)", pred, sim.gate(T + cn.abs(), pred), general=True,
                  ulp_sized=float(cn.abs().max()) <= small)


def half_operand_hypotheses(sim: Sim):
    """Operands dequantized, rounded to fp16 / bf16 and multiplied by a float matmul (accumulating
    in fp32) instead of the promised quantized GEMM: one quantized side, or every operand (an
    unquantized side too, as a half-precision matmul takes both in half precision)."""
    ctx = sim.ctx
    quant = [s for s in ("x", "w") if _q(ctx.xq if s == "x" else ctx.wq)]
    if not quant:
        return
    n, u = tol.rounding_count(sim.deq("x"), sim.deq("w"), "fp32", sim.bias is not None)
    for dt, nm in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        # the kernel dequantizes in float32, then casts: two roundings, as written
        rnd = {s: sim.deq(s).to(torch.float32).to(dt).double() for s in ("x", "w")}
        variants = [("every operand", ("x", "w"))] + [(f"the {_side(q)}", (q,)) for q in quant]
        for who, which in variants:
            Xr = rnd["x"] if "x" in which else sim.deq("x")
            Wr = rnd["w"] if "w" in which else sim.deq("w")
            pred, T = Xr @ Wr.T, Xr.abs() @ Wr.abs().T
            if sim.bias is not None:
                pred, T = pred + sim.bias, T + sim.bias.abs()
            yield Hyp("dequantized_then_half_matmul", f"{who} dequantized and rounded to {nm}, then a float "
                      f"matmul: the quantized GEMM was replaced by a {nm} matmul of dequantized values",
                      pred, tol.gate_from_sum(T, pred, n, max(u, sim.u), ctx.out_dtype), kind="numerical")
