"""GPTQ on a whole model: the plan's Linears replaced in execution order by QuantLinears whose codes
GPTQ chose on the inputs the already-quantized model feeds them (lowbit.algorithms.sequential)."""
from __future__ import annotations

import dataclasses
import math
import time

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.gptq.asym import float_target_handler
from lowbit.algorithms.gptq.experts import gptq_experts
from lowbit.algorithms.gptq.hessian import HessianAccumulator, _fit_rows, held_out_losses, panel_losses
from lowbit.algorithms.gptq.options import GPTQOptions
from lowbit.algorithms.gptq.solver import gptq_quantize_group
from lowbit.algorithms.scale_search import search_scales
from lowbit.algorithms.sequential import calibrate_sequentially
from lowbit.archs.experts import spec_for
from lowbit.nn.quant_linear import QuantLinear
from lowbit.quantize import quantize
from lowbit.recipes.plan import layer_act, plan


@torch.no_grad()
def gptq_model(model: torch.nn.Module, recipe, calib, options: GPTQOptions | None = None, *, ignore=None,
               overrides=None, act_static_scales=None, progress: bool = False, **changes):
    """quantize_model with GPTQ weights: the same plan (recipe, ignore, overrides; lm_head and tied
    Linears stay float), each Linear replaced in execution order by a QuantLinear whose weight GPTQ
    chose on the inputs that the already-quantized model feeds it (lowbit.algorithms.sequential).
    calib: input-id tensors [B, T] or dicts of model kwargs. options: a GPTQOptions (damp, block_size,
    act_order, static_groups, holdout, backend, mse, min_tokens, targets: described there), or its
    fields as keywords, which replace the options' fields.

    holdout: a layer whose GPTQ weight loses to round to nearest's on the held-out tokens keeps the
    round-to-nearest codes (GPTQ over-fits when the tokens are few for K, e.g. a down_proj with
    K = 1536 on 2,048 tokens). mse: the held-out fallback uses the MSE-optimal scales too.
    Every decision's `reason` gains the layer's loss relative to round-to-nearest and the choice.
    MoE experts modules the plan quantizes (summary.experts, a plan of lowbit.pipelines.quantize_model)
    are solved per expert on the tokens routed to each (lowbit.algorithms.gptq.experts; min_tokens: its
    few-token rule); each decision's `calibration` holds the per-expert report. targets="float" is
    refused for them.
    Returns the QuantSummary; on error the model is left as it was."""
    o = GPTQOptions.merge(options, changes, "gptq_model")
    summary = plan(model, recipe, ignore, overrides)
    experts = [d.name for d in summary.experts if d.action == "quantized"]
    if experts and (o.targets == "float" or act_static_scales is not None):
        raise NotImplementedError(f"GPTQ of MoE experts ({experts[0]}, ...) supports neither targets='float' nor "
                                  "act_static_scales; drop the option, or keep the experts in high precision "
                                  "with ignore=[...]")
    # the handler fits the weights it is given; for targets="float" the wrapper gives it W'
    handle = gptq_handler(model, summary, act_static_scales, dataclasses.replace(o, targets="quantized"))
    if o.targets == "float":
        calib = list(calib)
        handle = float_target_handler(model, [d.name for d in summary.quantized], calib, handle, damp=o.damp,
                                      holdout=o.holdout)
    calibrate_sequentially(model, [d.name for d in summary.quantized] + experts, calib, handle, progress=progress,
                           desc=f"GPTQ {summary.recipe}")
    summary.method = "gptq"
    return summary


def gptq_handler(model: torch.nn.Module, summary, act_static_scales=None, options: GPTQOptions | None = None, *,
                 host_twin: bool = True, **changes):
    """The lowbit.algorithms.sequential handler that replaces a group of Linears sharing one input by their
    GPTQ QuantLinears (options: a GPTQOptions or its fields as keywords, as gptq_model's; `summary` from
    lowbit.recipes.plan.plan). Used by gptq_model on a whole model and by lowbit.pipelines.layerwise one
    decoder layer at a time. host_twin: QuantLinear's (4-bit codes' exact twin on the host, or left on
    the device, where lowbit.pipelines.layerwise packs them for the checkpoint without the host copy of
    every code)."""
    o = GPTQOptions.merge(options, changes, "gptq_handler")
    if o.targets != "quantized":
        raise ValueError(f"targets={o.targets!r}: gptq_handler fits each layer to its own weight; fitting the float "
                         "model's outputs needs the float model's inputs, which gptq_model captures (targets='float' "
                         "there, on a whole model)")
    decisions = {d.name: d for d in summary.quantized}
    experts = {d.name: d for d in summary.experts if d.action == "quantized"}

    def experts_handle(n, inputs):
        """The GPTQ QuantExperts of one experts module (lowbit.algorithms.gptq.experts)."""
        d, mod = experts[n], model.get_submodule(n)
        r = summary.recipes[d.recipe]
        try:
            q, cal = gptq_experts(mod, spec_for(mod), r.weight, r.act, inputs, o, name=n)
        except ValueError as err:
            raise ValueError(f"GPTQ of experts {n} (E, 2I, H = {d.shape}): {err}") from err
        d.calibration = cal
        d.reason += "; GPTQ per expert"
        dev = next(iter(mod.parameters())).device
        return {n: q.to(dev)}

    def weights(n, qt, sc):
        """The float64 weight [N, K] and the dequantized GPTQ and round-to-nearest weights (round
        to nearest under the fixed scales sc where given)."""
        d, lin = decisions[n], model.get_submodule(n)
        w = lin.weight.detach()
        w64 = w.double() if w.dtype != torch.float64 else w
        rtn = quantize(w64.float(), summary.recipe_of(d).weight, pad=True, scales=sc)
        return w64, qt.dequantize(torch.float64), rtn.dequantize(torch.float64)


    timings = {"hessian": 0.0, "factor": 0.0, "solve": 0.0, "losses": 0.0, "build": 0.0}
    clock = [0.0]

    def lap(phase, dev):     # seconds per phase (device queue drained), read by layerwise's summary
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.time()
        if phase is not None:
            timings[phase] += now - clock[0]
        clock[0] = now

    def hessian(inputs, K):
        """X^T X / n of the fit tokens (all but every holdout-th), all ranks' (a collective): the
        batches' products accumulated in chunks (HessianAccumulator with counts: no K x K term per
        batch; ranks > 0 hold a few chunk sums). The accumulator is dropped on return: only H
        stays alive."""
        acc = HessianAccumulator(K, counts=distributed.counts(len(inputs)))
        for x in inputs:
            acc.add(_fit_rows(x.reshape(-1, K), o.holdout))
        acc.reduce()      # a collective: every rank, same order
        return acc.hessian()

    def handle(names, inputs):
        if names[0] in experts:
            return experts_handle(names[0], inputs)
        K = model.get_submodule(names[0]).in_features
        dev = model.get_submodule(names[0]).weight.device
        lap(None, dev)
        h = hessian(inputs, K)
        lap("hessian", dev)
        lins = [model.get_submodule(n) for n in names]
        schemes = [summary.recipe_of(decisions[n]).weight for n in names]
        scs = [None] * len(names)
        if o.mse:     # fixed scales: MSE-optimal, weighted by the fit Hessian's diagonal (every rank alike)
            scs = [search_scales(lin.weight.detach(), s, hdiag=torch.diagonal(h)) for lin, s in zip(lins, schemes)]
        # One column loop per run of Linears with the same scheme (q/k/v, gate/up concatenated);
        # under torch.distributed each rank solves its share of the rows and every rank ends
        # with every weight (gptq_quantize_group).
        try:
            qts = gptq_quantize_group([lin.weight for lin in lins], h, schemes, damp=o.damp, block_size=o.block_size,
                                      act_order=o.act_order, static_groups=o.static_groups, scales=scs,
                                      on_factored=lambda: lap("factor", dev))
        except ValueError as err:
            shapes = ", ".join(f"{n} {list(decisions[n].shape)}" for n in names)
            raise ValueError(f"GPTQ of layer(s) {shapes}: {err}") from err
        lap("solve", dev)
        world, me = distributed.world_size(), distributed.rank()
        # W - Q of GPTQ's and of round to nearest's weight, for every Linear of the group
        ds = []
        for n, qt, sc in zip(names, qts, scs):
            w64, qg, qr = weights(n, qt, sc)
            ds += [w64 - qg, w64 - qr]
            del w64, qg, qr
        # The choice, GPTQ or round to nearest, on the held-out tokens: their output errors from
        # the tokens themselves, each rank on its batches, summed in batch order (no held-out
        # Hessian: no second K x K matrix, no second ordered chain of them, ~30% fewer flops
        # for a Llama-8B layer than building it and multiplying by it).
        hv = held_out_losses(inputs, o.holdout, ds) if o.holdout else None
        # The report: the losses on the fit tokens, tr(D H D^T), by row panels shared out over
        # the ranks (every rank a share of every Linear's [N, K] x [K, K] product: balanced
        # whatever the Linears' sizes), the panels' values added exactly on every rank.
        hd = h.to(lins[0].weight.device)
        fit = [panel_losses(d, hd, world, me) for d in ds]
        del ds
        infos = []
        for i in range(len(names)):
            lq, l0 = fit[2 * i], fit[2 * i + 1]
            info = [lq / l0 if l0 > 0 else 1.0, math.nan, 0.0]
            if hv is not None:
                lv, lr = float(hv[2 * i]), float(hv[2 * i + 1])
                info[1:] = [lv / lr if lr > 0 else 1.0, float(lv > lr)]
            infos.append(info)
        lap("losses", dev)
        out = {}
        for i, n in enumerate(names):
            d, lin, r = decisions[n], lins[i], summary.recipe_of(decisions[n])
            info = infos[i]
            qt = qts[i]
            if info[2]:
                qt = quantize(lin.weight.detach().float(), r.weight, pad=True, scales=scs[i])
            d.reason += f"; GPTQ output loss {float(info[0]):.3f}x round-to-nearest's"
            if not math.isnan(float(info[1])):
                d.reason += f", {float(info[1]):.3f}x on held-out tokens"
                if info[2]:
                    d.reason += ": kept round-to-nearest"
            act, scale = layer_act(d, r, act_static_scales)
            bias = None if lin.bias is None else lin.bias.detach().float()
            out[n] = QuantLinear(qt, r.weight, act, bias=bias, act_static_scale=scale,
                                 backend=o.backend, host_twin=host_twin).to(lin.weight.device)
        lap("build", dev)
        return out

    handle.timings = timings
    return handle
