"""The MoE part of a whole-model quantization: plan which experts modules a recipe quantizes,
build their QuantExperts, and name the routers that stay in high precision.

Decisions are made for every experts module lowbit.archs.experts finds (an unknown fused one
raises there), with the same per-site controls as the Linears: an ignore pattern or an
override to "skip" keeps a module in float (and the coverage report says so), an override
names another recipe. Nothing is swapped into the model until every module has been built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.algorithms.gptq.experts import mse_weights
from lowbit.archs.experts import ExpertsSpec, find_experts, router_of
from lowbit.nn.experts import QuantExperts
from lowbit.recipes.plan import by_patterns


@dataclass
class ExpertsDecision:
    """What a quantization did with one experts module: "quantized" or "skipped", and why.
    shape: (E, 2I, H) of gate_up as [E, N, K]."""
    name: str
    family: str
    shape: tuple[int, int, int]
    action: str
    recipe: str | None
    reason: str
    calibration: object = None      # lowbit.algorithms.gptq.experts.ExpertsCalibration when calibrated


def _shape(model: torch.nn.Module, name: str, spec: ExpertsSpec) -> tuple[int, int, int]:
    w = getattr(model.get_submodule(name), spec.gate_up)
    return (int(w.shape[0]), int(w.shape[1]), int(w.shape[2])) if spec.layout == "enk" else \
        (int(w.shape[0]), int(w.shape[2]), int(w.shape[1]))


def plan_experts(model: torch.nn.Module, base, ignore: list[str], overrides: dict
                 ) -> tuple[dict[str, ExpertsSpec], list[ExpertsDecision]]:
    """(name -> spec, decisions) for every experts module. base: the Recipe; overrides:
    {pattern: Recipe | "skip"}, decided by the plan's rule (lowbit.recipes.plan.by_patterns)."""
    found = find_experts(model)
    out = []
    for name, spec in found.items():
        shape = _shape(model, name, spec)
        by_user = by_patterns(name, ignore, overrides, "experts")
        if by_user is not None:
            out.append(ExpertsDecision(name, spec.family, shape, *by_user))
        else:
            out.append(ExpertsDecision(name, spec.family, shape, "quantized", base.name, "recipe"))
    return found, out


def router_names(model: torch.nn.Module, found: dict[str, ExpertsSpec]) -> list[str]:
    """Names of the routers and shared-expert gates beside every experts module (kept in high
    precision by rule, whether they are nn.Linear or a bare weight)."""
    out = []
    for name, spec in found.items():
        r = router_of(model, name, spec)
        if r is not None:
            out.append(r[0])
        if spec.shared_gate:
            parent = name.rpartition(".")[0]
            gate = f"{parent}.{spec.shared_gate}" if parent else spec.shared_gate
            try:
                model.get_submodule(gate)
                out.append(gate)
            except AttributeError:
                pass
    return out


def keep_routers(model: torch.nn.Module, found: dict[str, ExpertsSpec], summary) -> list[str]:
    """Mark the Linear routers and shared-expert gates the plain recipe would quantize in
    `summary` (a lowbit.recipes.plan.QuantSummary) as kept in high precision, and return every
    router name (router_names). An explicit override of one (reason other than "recipe") stands."""
    routers = router_names(model, found)
    for d in summary.layers:
        if d.name in routers and d.reason == "recipe":
            d.action, d.recipe, d.reason = "skipped", None, "MoE router / gate stays high precision"
    return routers


def build_experts(model: torch.nn.Module, found: dict[str, ExpertsSpec], decisions: list[ExpertsDecision],
                  recipes: dict, mse: bool = False) -> dict[str, QuantExperts]:
    """QuantExperts for every quantized decision (the model is not changed). recipes: name ->
    Recipe; mse: each expert on MSE-optimal scales (lowbit.algorithms.gptq.experts.mse_weights)
    instead of round to nearest's. An error names the module and the way out."""
    new = {}
    for d in decisions:
        if d.action != "quantized":
            continue
        spec, r = found[d.name], recipes[d.recipe]
        try:
            mod = model.get_submodule(d.name)
            new[d.name] = QuantExperts.from_module(
                mod, r.weight, r.act, name=d.name, quantized=mse_weights(mod, spec, r.weight) if mse else None,
                **spec.module_kwargs())
        except (ValueError, NotImplementedError) as err:
            raise type(err)(f"experts {d.name} (E, 2I, H = {d.shape}) under recipe {r.name}: {err}. Keep them in "
                            f"high precision with ignore=[{d.name!r}] or override them.") from err
    return new


def swap_in(model: torch.nn.Module, new: dict[str, torch.nn.Module]) -> None:
    """Replace each named module by its new one (on the old one's device)."""
    for name, q in new.items():
        parent, _, attr = name.rpartition(".")
        old = model.get_submodule(name)
        dev = next(iter(old.parameters())).device
        setattr(model.get_submodule(parent) if parent else model, attr, q.to(dev))
