"""Static (calibrated) activation scales beside dynamic ones, and the clipping report that
shows when they have gone stale (scales calibrated on short English prompts and served long code
or other languages: activations exceed the range and clip).

A static scale is one float32 number per Linear input, s = calib_absmax / fmt.max; its arithmetic
(static_scheme, scale_from_absmax, quantize_static) lives in lowbit.quantize with the rest of the
scale rules. At run time every input is divided by that fixed s and saturated: values beyond
s * fmt.max clip.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch

from lowbit.algorithms import distributed
from lowbit.quantize import scale_from_absmax, static_scheme
from lowbit.nn.quant_linear import QuantLinear
from lowbit.scheme import QuantScheme


@torch.no_grad()
def calibrate_act_absmax(model: torch.nn.Module, batches: Iterable, names: Iterable[str] | None = None,
                         per_channel: bool = False, progress=None, run=None) -> dict[str, torch.Tensor]:
    """Largest |input| seen by each nn.Linear (or those in `names`) over `batches`.
    per_channel=False: a 0-d float32 tensor per layer; True: float32 [in_features] (SmoothQuant).
    `batches`: iterable of input-id tensors [B, T] or dicts of model kwargs. run: callable(model,
    batch) that runs one item of `batches` (default model(**b) / model(b)); the layer-by-layer
    path passes one that also keeps the output, so one forward gives the maxima and the next
    inputs. Under torch.distributed: this rank's share of the batches; the result is all ranks'
    maximum, reduced in ONE collective over a flat buffer of every Linear's statistic."""
    wanted = None if names is None else set(names)
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    last = [None, None]      # (weak reference to the last input seen, its maximum)

    def make(name):
        def hook(mod, args):
            # Linears fed the same tensor (q/k/v, gate/up) share its maximum: computed once
            if last[0] is not None and last[0]() is args[0]:
                m = last[1]
            else:
                # |x| and its maximum are exact in x's own dtype, and so is the cast of the
                # maximum: no float32 copy of a [tokens, K] input (the layer-by-layer peak memory)
                x = args[0].detach()
                m = (x.abs().reshape(-1, x.shape[-1]).amax(dim=0) if per_channel else x.abs().amax()).float()
                last[0], last[1] = weakref.ref(args[0]), m
            stats[name] = m if name not in stats else torch.maximum(stats[name], m)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (wanted is None or name in wanted):
            hooks.append(mod.register_forward_pre_hook(make(name)))
    if not hooks:
        raise ValueError("calibration found no nn.Linear layers to observe (names matched nothing?)")
    if run is None:
        def run(m, b):
            return m(**b) if isinstance(b, dict) else m(b)
    try:
        for b in (progress(batches) if progress else batches):
            run(model, b)
    finally:
        for h in hooks:
            h.remove()
    if distributed.active():
        # All ranks' maxima (exact: MAX is order-free), every Linear's in one flat buffer (one
        # collective per call, not one per Linear: each is a synchronization of all ranks). A
        # layer this rank's batches never reached contributes 0, the identity of a maximum of
        # magnitudes.
        mods = dict(model.named_modules())
        order = sorted(n for n, m in mods.items() if isinstance(m, torch.nn.Linear) and (wanted is None or n in wanted))
        dev = mods[order[0]].weight.device
        sizes = [mods[n].in_features if per_channel else 1 for n in order]
        flat = torch.cat([stats[n].reshape(-1).to(dev) if n in stats else
                          torch.zeros(k, dtype=torch.float32, device=dev) for n, k in zip(order, sizes)])
        flat = distributed.all_max(flat)
        for n, part in zip(order, torch.split(flat, sizes)):
            stats[n] = part if per_channel else part.reshape(())
    return stats


def calibrate_static_scales(model: torch.nn.Module, batches: Iterable, act: QuantScheme,
                            names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """One static scale (float32 [1, 1]) per Linear input, from the float model on `batches`.
    Pass the result to `quantize_model(..., act_static_scales=...)`."""
    scheme = static_scheme(act)
    return {n: scale_from_absmax(a, scheme) for n, a in calibrate_act_absmax(model, batches, names).items()}


@torch.no_grad()
def clipping_report(model: torch.nn.Module, batches: Iterable) -> list[dict]:
    """Run `batches` through a model with static-scale QuantLinears and report, per layer, the
    fraction of input elements beyond the static range and max |x| / (s * fmt.max)
    (> 1 means the calibration never saw inputs this large). Sorted worst first."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.act_static_scale is not None}
    if not layers:
        raise ValueError("model has no QuantLinear with a static activation scale: quantize with act_static_scales")
    for m in layers.values():
        m.track_clipping, m.clip_stats = True, {"clipped": 0, "seen": 0, "max_ratio": 0.0}
    try:
        for b in batches:
            model(**b) if isinstance(b, dict) else model(b)
    finally:
        for m in layers.values():
            m.track_clipping = False
    rows = [{"name": n, "clip_rate": m.clip_stats["clipped"] / max(m.clip_stats["seen"], 1),
             "max_ratio": m.clip_stats["max_ratio"], "scale": float(m.act_static_scale)} for n, m in layers.items()]
    return sorted(rows, key=lambda r: (-r["clip_rate"], -r["max_ratio"]))
