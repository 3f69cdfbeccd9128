"""GPTQ (Frantar et al., 2022): quantize a Linear weight column by column, pushing each column's
rounding error onto the columns not yet quantized so that the layer's OUTPUT error on the
calibration inputs is small, not the weight error.

For a Linear y = x @ W.T with calibration inputs X [n, K] the layer's output loss of a quantized
weight Q is  tr((W - Q) H (W - Q)^T)  with  H = X^T X / n  [K, K]. Quantizing column j to q_j and
updating the columns that are still free by the optimal compensation (OBS)
    W[:, F] -= (w_j - q_j) / [H_F^-1]_jj * [H_F^-1]_{j, F}
is GPTQ's step. The implementation here is the paper's fast form: the rows of the upper
Cholesky factor of H^-1 give every [H_F^-1] row at once, and the updates are applied lazily in
blocks of `block_size` columns (one matrix product per block outside the block).

The grid is the scheme's own quantizer: every column goes through `lowbit.quantize` with the
layer's scales (`Scales`, expanded to that column), and the stored QTensor is
`lowbit.quantize(U, scheme, scales=S, pad=True)` where U holds each column as it was when it was
quantized. The codes are therefore exactly what `lowbit.quantize` stores for those values and
scales; the arithmetic of the quantized layer is unchanged, GPTQ only chooses other codes.

Scales: for `strategy="group"` schemes a group's scales are computed (by `compute_scale`, the one
place of scale arithmetic) from the group's columns as they are when GPTQ reaches the group, as
in the paper ("dynamic" groups). With `act_order=True` (columns visited in order of decreasing
H_jj) or `static_groups=True` the scales are those round-to-nearest would use on the original
weight, fixed before the first column. The permutation of act-order only changes the ORDER in
which columns are quantized; codes and scales are stored in the original column order with the
original contiguous groups, so the checkpoint stays a plain compressed-tensors group layout (no
g_idx). Channel / tensor / block scales and NVFP4's tensor scale always come from the original
weight. `sequential_gptq` (model level) calibrates each layer on the outputs of the layers
before it that are already quantized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.formats import decode
from lowbit.nn import distributed
from lowbit.nn.distributed import OrderedSum
from lowbit.quantize import (QTensor, Scales, compute_scale, encode_scaled, expand_scale, quantize, reduce_amax,
                             reduce_minmax)
from lowbit.scheme import QuantScheme


class HessianAccumulator:
    """Running H = X^T X / n (float64 [K, K]) over calibration inputs X of any shape [..., K].

    The sum lives on the inputs' device (`device` overrides). Under torch.distributed each rank
    adds its own batches and `hessian()` returns the Hessian of ALL ranks' batches, bit-identical
    to one process adding them in order (lowbit.nn.distributed.OrderedSum); it is then a
    collective call that every rank makes."""

    def __init__(self, in_features: int, device=None):
        self.in_features = in_features
        self.device = device
        self._sum = OrderedSum()
        self.n = 0
        self._dist = distributed.active()
        self._total = None              # the ranks' combined sum, once reduce() ran (distributed)

    def add(self, x: torch.Tensor) -> None:
        if self._total is not None:
            raise RuntimeError("HessianAccumulator.add after hessian(): the ranks' sums were already combined")
        x2 = x.detach().reshape(-1, x.shape[-1]).to(device=self.device or x.device, dtype=torch.float64)
        if x2.shape[1] != self.in_features:
            raise ValueError(f"calibration input has {x2.shape[1]} features, the layer has {self.in_features}")
        self._sum.add(x2.T @ x2)
        self.n += x2.shape[0]

    def reduce(self) -> None:
        """Combine the ranks' sums (a collective; a no-op in one process); idempotent."""
        if self._dist and self._total is None:
            total = self._sum.total((self.in_features, self.in_features), self.device)
            self.n = distributed.all_count(self.n)
            self._total = total if total is not None else torch.zeros(
                self.in_features, self.in_features, dtype=torch.float64, device=self.device)

    @property
    def sum(self) -> torch.Tensor:
        """X^T X over all inputs so far (all ranks': a collective under torch.distributed)."""
        if self._dist:
            self.reduce()
            return self._total
        s = self._sum.total((self.in_features, self.in_features))
        return torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=self.device) if s is None else s

    def hessian(self) -> torch.Tensor:
        s = self.sum
        if self.n == 0:
            raise ValueError("no calibration input reached this layer: GPTQ needs calibration batches")
        return s / self.n


@dataclass
class GPTQResult:
    """qtensor: the quantized weight (lowbit.quantize layout, padded along K like pad=True);
    loss / loss_rtn: tr((W-Q) H (W-Q)^T) for GPTQ and for round-to-nearest on the same H."""
    qtensor: QTensor
    loss: float
    loss_rtn: float


def _fake_quant(col: torch.Tensor, sc: Scales, scheme: QuantScheme) -> torch.Tensor:
    """Dequantized float64 [N] of one float32 column [N] under its scales ([N, 1] each): the
    element step of lowbit.quantize (encode_scaled) and QTensor.dequantize's arithmetic."""
    s = sc.scale[:, 0]
    codes = encode_scaled(col / s, None if sc.zero_point is None else sc.zero_point[:, 0], scheme.fmt)
    vals = codes.double() if scheme.type == "int" else decode(codes, scheme.fmt).double()
    if sc.zero_point is not None:
        vals = vals - sc.zero_point[:, 0].double()
    return vals * s.double()


def output_loss(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) in float64: the summed squared output error over the calibration
    inputs (divided by n when H = X^T X / n)."""
    d = w.double() - q.double()
    return float(((d @ h.double()) * d).sum())


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


def _column(sc: Scales, j: int) -> Scales:
    col = lambda t: None if t is None else t[:, j:j + 1].contiguous()  # noqa: E731
    return Scales(col(sc.scale), col(sc.zero_point), col(sc.scale_codes), sc.global_scale)


def _set_group(full: Scales, gi: int, sc: Scales) -> None:
    for dst, src in zip(full[:3], sc[:3]):
        if dst is not None:
            dst[:, gi:gi + 1] = src


def gptq_quantize_weight(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, *, damp: float = 0.01,
                         block_size: int = 128, act_order: bool = False, static_groups: bool = False,
                         scales: Scales | None = None) -> GPTQResult:
    """GPTQ of one weight.

    w: [N, K] float weight (y = x @ w.T); h: [K, K] Hessian X^T X / n (HessianAccumulator).
    damp: fraction of mean(diag H) added to the diagonal before inverting (the paper's 1%).
    block_size: columns per lazy-update block (rounded up to a multiple of the group size for
      dynamic group scales, so that a group's scales see its columns' current values).
    act_order / static_groups: see the module docstring.
    scales: fixed scales for every group (e.g. lowbit.nn.scale_search's MSE-optimal ones; shapes of
      quantize(w, scheme, pad=True).scale) instead of round to nearest's; loss_rtn is then the loss
      of round to nearest under these scales.
    Returns the QTensor (padded along K when the group size does not divide K) and the losses.
    Columns that no calibration input reaches (H_jj = 0) get H_jj = 1: they are rounded to
    nearest and receive no compensation.
    """
    if w.ndim != 2:
        raise ValueError(f"w must be a 2-D [out_features, in_features] weight, got shape {tuple(w.shape)}")
    N, K = w.shape
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
    group = scheme.strategy == "group"
    dynamic_groups = group and not (act_order or static_groups or scales is not None)
    dev = w.device                      # GPTQ runs where the weight lives (CPU or one GPU)
    h = h.double().to(dev)
    w64 = w.detach().double()
    rtn = quantize(w64.float(), scheme, pad=True, scales=scales)
    pshape = tuple(rtn.codes.shape)
    # Scales: RTN's on the original weight; dynamic groups overwrite each group when reached.
    full = Scales(*(None if t is None else t.clone() for t in _scales_of(rtn)))
    if dynamic_groups:
        block_size = -(-block_size // scheme.group_size) * scheme.group_size

    H = h.clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(K, device=dev)
    order = perm.tolist()               # host copy: the column loop indexes it without a device sync
    W = w64[:, perm].clone()
    H = H[perm][:, perm]
    H += damp * torch.diagonal(H).mean() * torch.eye(K, dtype=torch.float64, device=dev)
    L, info = torch.linalg.cholesky_ex(H)
    if info:
        raise ValueError(f"the damped Hessian is not positive definite (damp={damp}); raise damp (e.g. 0.1) "
                         "or give more calibration tokens")
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)   # rows: [H_F^-1]_{j,F} / sqrt(.)

    U = torch.zeros(N, K, dtype=torch.float32, device=dev)   # each column as it was quantized (original order)
    Q = torch.zeros(N, K, dtype=torch.float64, device=dev)   # its dequantized value
    ex = None if dynamic_groups else _expanded(full, scheme, pshape)
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = order[i1 + i]
            if dynamic_groups and j % scheme.group_size == 0:
                sc = _group_scales(W1[:, i:i + scheme.group_size], scheme, full.global_scale)
                _set_group(full, j // scheme.group_size, sc)
                ex = _expanded(full, scheme, pshape)
            col = W1[:, i].float()
            q = _fake_quant(col, _column(ex, j), scheme)
            U[:, j], Q[:, j] = col, q
            err = (W1[:, i] - q) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    qt = quantize(U, scheme, pad=True, scales=full)
    deq = qt.dequantize(torch.float64)
    if not torch.equal(deq, Q):     # the column step and lowbit.quantize must be one arithmetic
        raise RuntimeError("GPTQ: the stored codes do not reproduce the values the updates assumed "
                           f"({int((deq != Q).sum())} of {Q.numel()} differ); this is a lowbit bug, please report it")
    return GPTQResult(qt, output_loss(w64, deq, h),
                      output_loss(w64, rtn.dequantize(torch.float64), h))


@torch.no_grad()
def gptq_model(model: torch.nn.Module, recipe, calib, *, ignore=None, overrides=None, act_static_scales=None,
               damp: float = 0.1, block_size: int = 128, act_order: bool = True, static_groups: bool = False,
               holdout: int = 4, backend: str = "auto", progress: bool = False, mse: bool = False):
    """quantize_model with GPTQ weights: the same plan (recipe, ignore, overrides; lm_head and tied
    Linears stay float), each Linear replaced in execution order by a QuantLinear whose weight GPTQ
    chose on the inputs that the already-quantized model feeds it (lowbit.nn.sequential).
    calib: input-id tensors [B, T] or dicts of model kwargs.

    holdout: every holdout-th calibration token is kept out of the Hessian and used to validate:
    a layer whose GPTQ weight has a larger output loss than round-to-nearest's on those tokens
    keeps the round-to-nearest codes (GPTQ over-fits when the tokens are few for K, e.g. a
    down_proj with K = 1536 on 2,048 tokens). 0 disables the check. The defaults (damp 0.1,
    act_order, holdout 4) are what measured best on SmolLM2 (docs/perplexity.md).
    mse: the fixed scales come from lowbit.nn.scale_search (MSE-optimal range per scale, weighted by
    the Hessian's diagonal) instead of round to nearest's; the held-out fallback uses them too.
    Every decision's `reason` gains the layer's loss relative to round-to-nearest and the choice.
    Returns the QuantSummary; on error the model is left as it was."""
    from lowbit.nn.quantize_model import plan
    from lowbit.nn.sequential import calibrate_sequentially
    summary = plan(model, recipe, ignore, overrides)
    handle = gptq_handler(model, summary, act_static_scales, damp=damp, block_size=block_size, act_order=act_order,
                          static_groups=static_groups, holdout=holdout, backend=backend, mse=mse)
    calibrate_sequentially(model, [d.name for d in summary.quantized], calib, handle, progress=progress,
                           desc=f"GPTQ {summary.recipe}")
    summary.method = "gptq"
    return summary


def gptq_handler(model: torch.nn.Module, summary, act_static_scales=None, *, damp: float = 0.1,
                 block_size: int = 128, act_order: bool = True, static_groups: bool = False, holdout: int = 4,
                 backend: str = "auto", mse: bool = False):
    """The lowbit.nn.sequential handler that replaces a group of Linears sharing one input by their
    GPTQ QuantLinears (gptq_model's options; `summary` from quantize_model.plan). Used by
    gptq_model on a whole model and by lowbit.nn.layerwise one decoder layer at a time."""
    from lowbit.nn.quant_linear import QuantLinear
    from lowbit.nn.quantize_model import layer_act
    if holdout < 0 or holdout == 1:
        raise ValueError(f"holdout={holdout}: give 0 (no validation) or n >= 2 (every n-th token validates)")
    decisions = {d.name: d for d in summary.quantized}

    def solve(n, h, hv):
        """GPTQ of one layer: (QTensor, float64 [3] = loss ratio, held-out ratio or NaN, kept RTN)."""
        d, lin = decisions[n], model.get_submodule(n)
        r = summary.recipe_of(d)
        sc = None
        if mse:
            from lowbit.nn.scale_search import search_scales
            sc = search_scales(lin.weight.detach(), r.weight, hdiag=torch.diagonal(h))
        try:
            res = gptq_quantize_weight(lin.weight, h, r.weight, damp=damp, block_size=block_size,
                                       act_order=act_order, static_groups=static_groups, scales=sc)
        except ValueError as err:
            raise ValueError(f"GPTQ of layer {n} ({d.shape[0]}x{d.shape[1]}) under recipe {r.name}: {err}") from err
        qt = res.qtensor
        info = [res.loss / res.loss_rtn if res.loss_rtn > 0 else 1.0, math.nan, 0.0]
        if hv is not None:
            w = lin.weight.detach()
            rtn = quantize(w.float(), r.weight, pad=True, scales=sc)
            lv, lr = output_loss(w, qt.dequantize(torch.float64), hv), output_loss(w, rtn.dequantize(torch.float64), hv)
            info[1] = lv / lr if lr > 0 else 1.0
            if lv > lr:
                qt, info[2] = rtn, 1.0
        return qt, torch.tensor(info, dtype=torch.float64)

    def handle(names, inputs):
        K = model.get_submodule(names[0]).in_features
        fit, val = HessianAccumulator(K), HessianAccumulator(K)
        for x in inputs:
            x2 = x.reshape(-1, K)
            if holdout:
                sel = torch.arange(x2.shape[0], device=x2.device) % holdout == holdout - 1
                fit.add(x2[~sel])
                if bool(sel.any()):
                    val.add(x2[sel])
            else:
                fit.add(x2)
        fit.reduce()      # collectives: every rank, same order
        val.reduce()
        h = fit.hessian()
        hv = val.hessian() if holdout and val.n else None
        # Under torch.distributed the layers sharing this input are solved by different ranks
        # (layer i by rank i % world) and the results broadcast; one process solves them all.
        world, me = distributed.world_size(), distributed.rank()
        mine = {n: solve(n, h, hv) for i, n in enumerate(names) if i % world == me}
        out = {}
        for i, n in enumerate(names):
            d, lin = decisions[n], model.get_submodule(n)
            r = summary.recipe_of(d)
            if n in mine:
                qt, info = mine[n]
            else:   # same shapes and dtypes as the owner's result; its values arrive by broadcast
                qt, info = quantize(lin.weight.detach().float(), r.weight, pad=True), torch.zeros(3, dtype=torch.float64)
            if world > 1:
                for t in (qt.codes, qt.scale, qt.zero_point, qt.scale_codes, qt.global_scale, info):
                    if t is not None:
                        distributed.broadcast_(t, src=i % world)
            d.reason += f"; GPTQ output loss {float(info[0]):.3f}x round-to-nearest's"
            if not math.isnan(float(info[1])):
                d.reason += f", {float(info[1]):.3f}x on held-out tokens"
                if info[2]:
                    d.reason += ": kept round-to-nearest"
            act, scale = layer_act(d, r, act_static_scales)
            bias = None if lin.bias is None else lin.bias.detach().float()
            out[n] = QuantLinear(qt, r.weight, act, bias=bias, act_static_scale=scale,
                                 backend=backend).to(lin.weight.device)
        return out

    return handle
