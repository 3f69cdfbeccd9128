"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized so that the layer's OUTPUT error on the
calibration inputs is small, not the weight error.

For a Linear y = x @ W.T with calibration inputs X [n, K] the layer's output loss of a quantized
weight Q is  tr((W - Q) H (W - Q)^T)  with  H = X^T X / n  [K, K]. Quantizing column j to q_j and
updating the columns that are still free by the optimal compensation (OBS)
    W[:, F] -= (w_j - q_j) / [H_F^-1]_jj * [H_F^-1]_{j, F}
is GPTQ's step. The implementation here is the paper's fast form: the rows of the upper
Cholesky factor of H^-1 give every [H_F^-1] row at once, and the updates are applied lazily in
blocks of `block_size` columns (one matrix product per block outside the block). Rows are
independent, so the weights that read one input are solved as one concatenated weight
(gptq_quantize_group), the lazy products run on fixed panels of PANEL_ROWS rows (the same bits
whether one process or N ranks, each with whole panels, solve them), and on CUDA a block's column
loop is one Triton kernel (lowbit.algorithms.gptq.block) instead of ~11 kernels per column.

The grid is the scheme's own quantizer: every column goes through `lowbit.quantize` with the
layer's scales (`Scales`, expanded to that column), and the stored QTensor is
`lowbit.quantize(U, scheme, scales=S, pad=True)` where U holds each column as it was when it was
quantized. The codes are therefore exactly what `lowbit.quantize` stores for those values and
scales; the arithmetic of the quantized layer is unchanged, GPTQ only chooses other codes.

Scales: for `strategy="group"` schemes a group's scales are computed (by `compute_scale`, the one
place of scale arithmetic) from the group's columns as they are when GPTQ reaches the group, as
in the paper ("dynamic" groups). With `act_order=True` (columns visited in order of decreasing
H_jj) or `static_groups=True` the scales are those round-to-nearest would use on the original
weight, fixed before the first column; fixed scales given by the caller (`scales`, e.g.
lowbit.algorithms.scale_search's MSE-optimal ones) are likewise used for every group. The permutation
of act-order only changes the ORDER in which columns are quantized; codes and scales are stored
in the original column order with the original contiguous groups, so the checkpoint stays a
plain compressed-tensors group layout (no g_idx). Channel / tensor / block scales and NVFP4's
tensor scale come from the original weight (or from the fixed scales). `sequential_gptq` (model
level) calibrates each layer on the outputs of the layers before it that are already quantized.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.gptq import hessian
from lowbit.algorithms.gptq.factor import _Factor, _factor
from lowbit.algorithms.gptq.hessian import output_loss
from lowbit.formats import decode, grid
from lowbit.quantize import (QTensor, Scales, compute_scale, encode_scaled, expand_scale, quantize, reduce_amax,
                             reduce_minmax)
from lowbit.scheme import QuantScheme


@dataclass
class GPTQResult:
    """qtensor: the quantized weight (lowbit.quantize layout, padded along K like pad=True);
    loss / loss_rtn: tr((W-Q) H (W-Q)^T) for GPTQ and for round-to-nearest on the same H."""
    qtensor: QTensor
    loss: float
    loss_rtn: float


def _fake_quant(x: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, s64: torch.Tensor,
                scheme: QuantScheme) -> torch.Tensor:
    """Dequantized float64 values of float32 `x` under its effective scales `s` (float32, x's
    shape or broadcastable; `s64` = s.double(), passed in so that a column loop converts once),
    zero points `zp` (int32 or None): the element step of lowbit.quantize (encode_scaled) and
    QuantTensor.dequantize's arithmetic, elementwise, for one column or a whole block. Float
    formats round on the format's value grid (lowbit.formats.grid: decode(encode()) bit for bit in
    a few operations; the column loop calls this once per column, and encode's ~20 elementwise
    passes were most of GPTQ's time under NVFP4)."""
    if scheme.type == "float" and grid.supported(scheme.fmt):
        return grid.nearest(x / s, scheme.fmt).double() * s64
    codes = encode_scaled(x / s, zp, scheme.fmt)
    vals = codes.double() if scheme.type == "int" else decode(codes, scheme.fmt).double()
    if zp is not None:
        vals = vals - zp.double()
    return vals * s64


def _scales_of(qt: QTensor) -> Scales:
    return Scales(qt.scale, qt.zero_point, qt.scale_codes, qt.global_scale)


def _group_scales(cols: torch.Tensor, scheme: QuantScheme, global_scale) -> Scales:
    """Scales of one group from its current columns [N, <= g] (zero-padded to g, as quantize(pad=True))."""
    g = scheme.group_size
    x = torch.nn.functional.pad(cols.float(), (0, g - cols.shape[1]))
    if scheme.symmetric:
        return compute_scale(reduce_amax(x, scheme), scheme, global_scale=global_scale)
    lo, hi = reduce_minmax(x, scheme)
    return compute_scale(hi, scheme, amin=lo)


def _expanded(sc: Scales, scheme: QuantScheme, shape) -> Scales:
    ex = lambda t: None if t is None else expand_scale(t, scheme, shape)  # noqa: E731
    return Scales(ex(sc.scale), ex(sc.zero_point), ex(sc.scale_codes), sc.global_scale)


def _set_group(full: Scales, gi: int, sc: Scales) -> None:
    for dst, src in zip(full[:3], sc[:3]):
        if dst is not None:
            dst[:, gi:gi + 1] = src


# The column loop of a block: "auto" runs the Triton kernel (lowbit.algorithms.gptq.block: one launch per
# block instead of ~11 per column) on CUDA for integer formats with fixed scales, after checking
# once per process that it reproduces the PyTorch loop bit for bit on the first block it sees
# (any difference or error switches it off, see BLOCK_KERNEL_STATUS); "torch" never runs it;
# "triton" runs it wherever it applies (on the CPU in Triton's interpreter: the tests).
BLOCK_KERNEL = "auto"
BLOCK_KERNEL_STATUS = "unused"     # "unused", "on (checked)", or "off: <why>"


def _kernel_wanted(scheme: QuantScheme, dynamic_groups: bool, dev: torch.device) -> bool:
    if BLOCK_KERNEL not in ("auto", "torch", "triton"):
        raise ValueError(f"lowbit.algorithms.gptq.solver.BLOCK_KERNEL={BLOCK_KERNEL!r}: choose 'auto', 'torch' or 'triton'")
    # the kernel's arithmetic: integer codes of at most 8 bits, scales fixed before the loop
    if BLOCK_KERNEL == "torch" or scheme.type != "int" or dynamic_groups or scheme.fmt.qmax > 255:
        return False
    if BLOCK_KERNEL == "triton":
        return True
    return dev.type == "cuda" and not BLOCK_KERNEL_STATUS.startswith("off")


def _block_kernel(W1, Err1, s1, z1, Hinv1, scheme) -> None:
    global BLOCK_KERNEL_STATUS
    from lowbit.algorithms.gptq import block as gptq_block    # optional: triton (the block kernel needs it)
    if BLOCK_KERNEL == "triton" or BLOCK_KERNEL_STATUS.startswith("on"):
        gptq_block.run_block(W1, Err1, s1, z1, Hinv1, scheme)
        return
    if BLOCK_KERNEL_STATUS.startswith("off"):
        _block_torch(W1, Err1, s1, z1, Hinv1, scheme, None, 0)
        return
    # first use in this process: the kernel must give the PyTorch loop's bits, or it is not used
    W_t, E_t = W1.clone(), Err1.clone()
    _block_torch(W_t, E_t, s1, z1, Hinv1, scheme, None, 0)
    try:
        gptq_block.run_block(W1, Err1, s1, z1, Hinv1, scheme)
        bad = int((W1 != W_t).sum()) + int((Err1 != E_t).sum())
        BLOCK_KERNEL_STATUS = "on (checked)" if bad == 0 else \
            f"off: {bad} of {2 * W1.numel()} values differ from the PyTorch loop"
    except Exception as err:      # a compiler or driver problem: the PyTorch loop still works
        BLOCK_KERNEL_STATUS = f"off: {type(err).__name__}: {str(err)[:300]}"
    if not BLOCK_KERNEL_STATUS.startswith("on"):
        import warnings
        warnings.warn(f"GPTQ's Triton block kernel is {BLOCK_KERNEL_STATUS}; using the PyTorch loop", stacklevel=3)
        W1.copy_(W_t)
        Err1.copy_(E_t)


def _block_torch(W1, Err1, s1, z1, Hinv1, scheme: QuantScheme, full: Scales | None, i1: int) -> None:
    """The column loop of one block in PyTorch, in place (gptq_block.run_block's arguments).
    full: the Scales to fill for dynamic groups (then s1 / z1 are filled here as each group is
    reached: its scales from its columns as they are now), None when the scales are fixed."""
    g = scheme.group_size
    s64 = None if full is not None else s1.double()
    for i in range(W1.shape[1]):
        if full is not None and (i1 + i) % g == 0:
            sc = _group_scales(W1[:, i:i + g], scheme, full.global_scale)
            _set_group(full, (i1 + i) // g, sc)
            s1[:, i:i + g] = sc.scale
            if z1 is not None:
                z1[:, i:i + g] = sc.zero_point
            s64 = s1.double()
        x = W1[:, i]
        q = _fake_quant(x.float(), s1[:, i], None if z1 is None else z1[:, i], s64[:, i], scheme)
        torch.div(x - q, Hinv1[i, i], out=Err1[:, i])
        # column i itself is not updated: it is never read again, and it keeps its value as
        # quantized, which U records after the block
        W1[:, i + 1:] -= Err1[:, i:i + 1] * Hinv1[i:i + 1, i + 1:]


@contextlib.contextmanager
def _one_thread(dev: torch.device):
    """PyTorch's CPU ops on one thread for the duration (the previous count restored after).

    The column loop runs ~13 small elementwise ops per column on [n] vectors and one [n, < block]
    update; PyTorch splits the update (above its grain of 32,768 elements) over its intra-op
    threads, which buys nothing at this size, and on a loaded machine each such split waits for a
    descheduled thread (up to ~50x slower than one thread). Elementwise results do not depend on the
    thread count, so the codes are the same. The count is process-wide while the loop runs."""
    n = torch.get_num_threads()
    if dev.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _solve(w64: torch.Tensor, fac: _Factor, scheme: QuantScheme, full: Scales, dynamic_groups: bool,
           block_size: int, kp: int) -> torch.Tensor:
    """GPTQ's column loop on the rows w64 [n, K] (float64, original column order). full: the
    scales of these rows, [n, G] tensors (kp: the padded K of their codes); dynamic groups overwrite each group's when GPTQ reaches
    it (in place). Returns U [n, K] float32: each column as it was when it was quantized (the
    stored codes are lowbit.quantize(U, scheme, scales=full)).

    Per column only elementwise steps on [n] vectors run (the quantization of the column, its
    error, the update of the block's later columns); the update of the later blocks is one
    matrix product per block and PANEL_ROWS rows (the paper's lazy batch)."""
    n, K = w64.shape
    pshape = (n, kp)
    W = w64[:, fac.perm]                 # a copy (advanced indexing)
    U = torch.empty(n, K, dtype=torch.float32, device=w64.device)
    ex = None if dynamic_groups else _expanded(full, scheme, pshape)
    use_kernel = _kernel_wanted(scheme, dynamic_groups, W.device)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        cols = fac.perm[i1:i2]
        W1 = W[:, i1:i2].clone()
        Err1 = torch.empty_like(W1)
        Hinv1 = fac.hinv[i1:i2, i1:i2]
        if dynamic_groups:      # columns in order, blocks of whole groups: filled as groups are reached
            s1 = torch.empty(n, i2 - i1, dtype=torch.float32, device=W.device)
            z1 = None if full.zero_point is None else torch.empty(n, i2 - i1, dtype=full.zero_point.dtype,
                                                                 device=W.device)
        else:
            s1 = ex.scale[:, cols].contiguous()
            z1 = None if ex.zero_point is None else ex.zero_point[:, cols]
        if use_kernel:
            _block_kernel(W1, Err1, s1, z1, Hinv1, scheme)
        else:
            with _one_thread(W.device):
                _block_torch(W1, Err1, s1, z1, Hinv1, scheme, full if dynamic_groups else None, i1)
        U[:, cols] = W1.float()
        if i2 < K:
            later = fac.hinv[i1:i2, i2:]
            for p0 in range(0, n, hessian.PANEL_ROWS):
                W[p0:p0 + hessian.PANEL_ROWS, i2:] -= Err1[p0:p0 + hessian.PANEL_ROWS] @ later
    return U


def _finish(U: torch.Tensor, full: Scales, scheme: QuantScheme) -> QTensor:
    """The stored QTensor of U under the scales GPTQ used, checked against the column step."""
    qt = quantize(U, scheme, pad=True, scales=full)
    deq = qt.dequantize(torch.float64)
    ex = _expanded(full, scheme, tuple(qt.codes.shape))
    K = U.shape[1]
    cut = lambda t: None if t is None else t[:, :K]  # noqa: E731
    want = _fake_quant(U, cut(ex.scale), cut(ex.zero_point), cut(ex.scale).double(), scheme)
    if not torch.equal(deq[:, :K], want):   # the column step and lowbit.quantize must be one arithmetic
        raise RuntimeError("GPTQ: the stored codes do not reproduce the values the updates assumed "
                           f"({int((deq[:, :K] != want).sum())} of {want.numel()} differ); this is a lowbit bug, "
                           "please report it")
    return qt


def _check(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, damp: float, block_size: int) -> None:
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}")
    K = w.shape[1]
    if tuple(h.shape) != (K, K):
        raise ValueError(f"h has shape {tuple(h.shape)}; a weight with K={K} input features needs [{K}, {K}]")
    if not torch.isfinite(w).all() or not torch.isfinite(h).all():
        raise ValueError("w or h holds NaN/Inf: fix the checkpoint or the calibration inputs before GPTQ")
    if not damp > 0:
        raise ValueError(f"damp={damp} must be > 0 (fraction of mean(diag H) added to the diagonal; 0.01 typical)")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if scheme.dynamic:
        raise ValueError("scheme must be static (dynamic=False): weights are quantized once")


def _row_split(scheme: QuantScheme) -> bool:
    """Whether a weight's rows can be solved apart: per-row scales (channel / group)."""
    return scheme.strategy in ("channel", "group")


def _mergeable(a: QuantScheme, b: QuantScheme) -> bool:
    """Whether two weights reading one input can be solved as one concatenated weight: the same
    per-row scheme and no per-weight tensor scale (NVFP4's global scale is each weight's own)."""
    return a == b and _row_split(a) and not a.two_level


def gptq_quantize_group(ws: list[torch.Tensor], h: torch.Tensor, schemes: list[QuantScheme], *,
                        damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                        static_groups: bool = False, split: bool | None = None,
                        scales: list[Scales | None] | None = None, on_factored=None) -> list[QTensor]:
    """GPTQ of the weights that read one input (so share the Hessian h [K, K]): ws[i] [N_i, K]
    under schemes[i]. Returns each weight's QTensor, the same codes as gptq_quantize_weight gives
    each of them (its rows are independent: tests/algorithms/test_gptq.py checks it bit for bit).

    Weights with the same per-row scheme are solved as one concatenated weight (one column loop
    for q/k/v, one for gate/up). split (default: torch.distributed is active): a collective;
    every rank solves its share of each such job's rows (whole PANEL_ROWS panels, shares
    differing by one panel at most, so each rank gets about K x N / world of every job) and the
    pieces are broadcast, so that every rank returns all weights; the triangular inverse of the
    Hessian's factor is shared out the same way (_factor: column panels by cost). A weight whose scales are not
    per row (tensor / block strategy) is solved whole by rank (its index mod world).
    scales: one entry per weight, its fixed scales (see gptq_quantize_weight) or None; a weight
    with fixed scales has no dynamic groups, and it is concatenated only with weights that also
    have fixed scales (their scales concatenated along rows as round to nearest's are).
    on_factored: called once the Hessian's factor exists (gptq_handler times the phases)."""
    for w, s in zip(ws, schemes):
        _check(w, h, s, damp, block_size)
    if scales is None:
        scales = [None] * len(ws)
    if len(scales) != len(ws):
        raise ValueError(f"scales has {len(scales)} entries for {len(ws)} weights: give one (Scales or None) per weight")
    if split is None:
        split = distributed.active()
    world, me = (distributed.world_size(), distributed.rank()) if split else (1, 0)
    dev = ws[0].device
    fac = _factor(h, damp, act_order, dev, world, me)
    if on_factored is not None:
        on_factored()
    # jobs: runs of consecutive weights solved as one
    jobs: list[list[int]] = []
    for i, s in enumerate(schemes):
        if jobs and _mergeable(schemes[jobs[-1][-1]], s) and \
                (scales[jobs[-1][-1]] is None) == (scales[i] is None):
            jobs[-1].append(i)
        else:
            jobs.append([i])
    out: list[QTensor | None] = [None] * len(ws)
    for ji, job in enumerate(jobs):
        scheme = schemes[job[0]]
        fixed = scales[job[0]] is not None      # the same for every weight of the job
        dynamic_groups = scheme.strategy == "group" and not (act_order or static_groups or fixed)
        bs = -(-block_size // scheme.group_size) * scheme.group_size if dynamic_groups else block_size
        if world == 1 or (_row_split(scheme) and not scheme.two_level):
            for i, qt in zip(job, _solve_rows(ws, job, scheme, scales, fac, dynamic_groups, bs, world, me)):
                out[i] = qt
            continue
        # a weight whose scales are not per row, or with a tensor scale of its own (two-level):
        # solved whole by one rank, U and the scales broadcast, every rank stores the codes
        i = job[0]
        rtn = quantize(ws[i].detach().double().float(), scheme, pad=True, scales=scales[i])
        full = _scales_of(rtn)
        w64 = ws[i].detach().double()
        owner = ji % world
        U = _solve(w64, fac, scheme, full, dynamic_groups, bs, rtn.codes.shape[1]) if me == owner else \
            torch.empty(w64.shape, dtype=torch.float32, device=dev)
        for t in (U, *full[:3]):
            if t is not None:
                distributed.broadcast_(t, src=owner)
        out[i] = _finish(U, full, scheme)
    return out


_QFIELDS = ("codes", "scale", "zero_point", "scale_codes")


def _solve_rows(ws: list[torch.Tensor], job: list[int], scheme: QuantScheme, scales: list, fac: _Factor,
                dynamic_groups: bool, bs: int, world: int, me: int) -> list[QTensor]:
    """GPTQ of the weights ws[job] (one per-row scheme: solved as one concatenated weight), this
    rank's rows only: round to nearest's scales of those rows (per-row scales: the rows' values
    in the whole weight's), the column loop, the stored codes and their check (_finish); then
    every rank's codes and scales are broadcast (one byte per weight for integer and 8-bit
    codes) and every rank returns every weight's QTensor. With world == 1 the rows are all rows
    (any scheme, two-level included: its global scale from the whole weight). A collective when
    world > 1. The codes are those of solving each weight whole (rows are independent)."""
    sizes = [ws[i].shape[0] for i in job]
    starts = [sum(sizes[:k]) for k in range(len(job))]
    n, K, dev = sum(sizes), ws[job[0]].shape[1], ws[job[0]].device
    lo, hi = hessian._rows_of(n, world, me) if world > 1 else (0, n)
    pieces = [(i, max(lo, st) - st, min(hi, st + m) - st) for i, st, m in zip(job, starts, sizes)
              if min(hi, st + m) > max(lo, st)]
    # round to nearest's scales of my rows (under the fixed scales where given)
    rtn = [quantize(ws[i][a:b].detach().double().float(), scheme, pad=True, scales=_row_scales(scales[i], a, b))
           for i, a, b in pieces]
    probe = rtn[0] if rtn else quantize(ws[job[0]][:1].detach().float(), scheme, pad=True,
                                        scales=_row_scales(scales[job[0]], 0, 1))
    kp = probe.codes.shape[1]
    full = {f: None if getattr(probe, f) is None else
            getattr(probe, f).new_empty((n,) + tuple(getattr(probe, f).shape[1:])) for f in _QFIELDS}
    gscale = probe.global_scale if world == 1 else None
    if hi > lo:
        mine = Scales(*(None if getattr(probe, f) is None else torch.cat([getattr(q, f) for q in rtn])
                        for f in _QFIELDS[1:]), gscale)
        del rtn
        w64 = torch.cat([ws[i][a:b].detach().double() for i, a, b in pieces])
        qt = _finish(_solve(w64, fac, scheme, mine, dynamic_groups, bs, kp), mine, scheme)
        del w64
        if world == 1:
            full = {f: getattr(qt, f) for f in _QFIELDS}
        else:
            for f in _QFIELDS:
                if full[f] is not None:
                    full[f][lo:hi] = getattr(qt, f)
        del qt
    for r in range(world if world > 1 else 0):     # every rank gets every rank's rows
        a, b = hessian._rows_of(n, world, r)
        if b > a:
            for f in _QFIELDS:
                if full[f] is not None:
                    distributed.broadcast_(full[f][a:b], src=r)
    return [QTensor(*(None if full[f] is None else full[f][st:st + m] for f in _QFIELDS[:3]), scheme, (m, K),
                    None if full["scale_codes"] is None else full["scale_codes"][st:st + m], gscale)
            for st, m in zip(starts, sizes)]


def _row_scales(sc: Scales | None, a: int, b: int) -> Scales | None:
    """Rows [a, b) of per-row fixed scales (None stays None)."""
    return None if sc is None else Scales(*(None if t is None else t[a:b] for t in sc[:3]), sc.global_scale)


def gptq_quantize_weight(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, *, damp: float = 0.01,
                         block_size: int = 128, act_order: bool = False, static_groups: bool = False,
                         scales: Scales | None = None) -> GPTQResult:
    """GPTQ of one weight (in this process, whether or not torch.distributed is active).

    w: [N, K] float weight (y = x @ w.T); h: [K, K] Hessian X^T X / n (HessianAccumulator).
    damp: fraction of mean(diag H) added to the diagonal before inverting (the paper's 1%).
    block_size: columns per lazy-update block (rounded up to a multiple of the group size for
      dynamic group scales, so that a group's scales see its columns' current values).
    act_order / static_groups: see the module docstring.
    scales: fixed scales for every group (e.g. lowbit.algorithms.scale_search's MSE-optimal ones; shapes of
      quantize(w, scheme, pad=True).scale) instead of round to nearest's; loss_rtn is then the loss
      of round to nearest under these scales.
    Returns the QTensor (padded along K when the group size does not divide K) and the losses.
    Columns that no calibration input reaches (H_jj = 0) get H_jj = 1: they are rounded to
    nearest and receive no compensation.
    """
    qt = gptq_quantize_group([w], h, [scheme], damp=damp, block_size=block_size, act_order=act_order,
                             static_groups=static_groups, split=False, scales=[scales])[0]
    w64 = w.detach().double()
    h = h.double().to(w.device)
    rtn = quantize(w64.float(), scheme, pad=True, scales=scales)
    return GPTQResult(qt, output_loss(w64, qt.dequantize(torch.float64), h),
                      output_loss(w64, rtn.dequantize(torch.float64), h))
