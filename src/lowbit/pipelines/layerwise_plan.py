"""What the layer-by-layer pipeline (lowbit.pipelines.layerwise) decides before it reads a layer:
from a checkpoint directory, a recipe, the job's steps and an ignore list to a LayerwisePlan.

The model is built on the meta device (no memory) from config.json. Every refusal happens here,
before any tensor is read or anything written (and, under torch.distributed, on every rank alike,
so no rank is left waiting in a collective for one that failed).

Llama-family models from transformers (LlamaForCausalLM and the models sharing its layout:
model.embed_tokens, model.layers[i], model.norm, lm_head), and the MoE families of MOE_FAMILIES
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3) in that layout. Their routed experts are
planned as quantize_model plans them (ignore patterns may name experts modules; routers and
shared-expert gates stay in high precision; shared experts are Linears) and written under the
family's checkpoint names (lowbit.pipelines.moe_checkpoint). The loader reads each fused experts
weight from the per-expert tensors transformers saves (layer_loader.model_sources); an experts
layout it cannot map, another MoE family (gpt-oss), SmoothQuant and static scales with experts are
refused by name. Tensors that from_pretrained keeps in float32 under a 16-bit dtype (DeepSeek-V3's
router) stay float32 (LayerwisePlan.keep_fp32).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.algorithms import distributed
from lowbit.algorithms.sequential import decoder_blocks
from lowbit.algorithms.smoothquant import refuse_experts
from lowbit.archs.decoders import decoder_for
from lowbit.archs.experts import find_experts
from lowbit.io import ct_layout as L
from lowbit.pipelines import layer_loader, moe_checkpoint as MC
from lowbit.pipelines.checkpoint import config_dict, read_json
from lowbit.pipelines.moe import keep_routers
from lowbit.pipelines.quantize_model import split_patterns
from lowbit.pipelines.steps import Step
from lowbit.quantize import static_scheme
from lowbit.recipes.plan import QuantSummary, plan
from lowbit.recipes.presets import Recipe

# The MoE families whose layers this path quantizes: per-expert checkpoint names it maps
# (lowbit.archs.experts.checkpoint_sources) and one attention mask for every layer, each checked
# against the whole-model path by tests/pipelines/test_layerwise.py.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")

# Where the decoder layers sit in the one layout this path knows.
LAYERS = "model.layers"


@dataclass
class LayerwisePlan:
    """Everything the runner and the writer need, decided before the first layer is read.

    recipe / steps: the resolved recipe and the job's steps in their order; streams: the activation
    streams the steps read ("F", "S", "Q": lowbit.pipelines.layerwise's module docstring); calib: the
    calibration batches as a list. model: the meta-device model (its decoder layers, `layers`, are
    the skeletons each loaded layer is copied from); config / cfg: its transformers config and
    config.json as a dict. summary: quantize_model's plan of the Linears (with the experts
    decisions, `experts`; `found`: the experts modules). sites / renamed: the experts modules'
    checkpoint names; unquantized: the checkpoint names kept in high precision (the config's
    ignore list). ckpt: the open input checkpoint (the caller closes it); reads: each layer's read
    plan (layer_loader.plan); own: the checkpoint tensors inside the layers (the rest is copied
    file to file); keep_fp32: each layer's tensors kept in float32 (names relative to the layer)."""
    recipe: Recipe
    steps: list
    streams: frozenset
    calib: list
    in_dir: Path
    cfg: dict
    config: object
    model: torch.nn.Module
    summary: QuantSummary
    experts: list
    found: dict
    sites: dict
    renamed: dict
    unquantized: list
    ckpt: layer_loader.Checkpoint
    reads: list
    own: set
    keep_fp32: list

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def experts_quantized(self) -> list:
        return [d for d in self.experts if d.action == "quantized"]

    @property
    def method(self) -> str:
        return "gptq" if "Q" in self.streams else "rtn"


def plan_layerwise(in_dir, r: Recipe, steps, calib, ignore, dtype: torch.dtype) -> LayerwisePlan:
    """The LayerwisePlan of quantize_layerwise's arguments (the recipe resolved there, at the
    library's boundary); every refusal, in this order: the steps, the checkpoint's config, the
    family and layout, the sites, the storage of the weights."""
    import transformers          # optional: transformers (the model skeleton is built from its config)

    steps = sorted(steps, key=lambda s: s.order)
    streams = _check_steps(r, steps)
    calib = list(calib or [])
    if streams and not calib:
        raise ValueError("calibration batches are needed for SmoothQuant, static scales and GPTQ: pass calib=[...]")
    in_dir = Path(in_dir)
    cfg, config, arch, model = _meta_model(transformers, in_dir)
    experts = _check_family(arch, model, config, streams)
    # the plan of quantize_model: an ignore pattern may name experts modules, routers and
    # shared-expert gates stay in high precision
    lin_ignore, _, found, decisions, _ = split_patterns(model, experts, r, ignore, None)
    summary = plan(model, r, lin_ignore or None)
    summary.experts = decisions
    routers = keep_routers(model, found, summary)      # Linear routers / shared-expert gates
    _check_storage(r, summary, [d for d in decisions if d.action == "quantized"])
    # checkpoint names: the families' own (Mixtral's block is block_sparse_moe on disk, its
    # experts one tensor per expert and projection), as save_compressed writes them
    sites = MC.experts_sites(model)
    renamed = MC.renames(sites)
    unquantized = [MC.rename(d.name, renamed) for d in summary.skipped] + [MC.rename(n, renamed) for n in routers]
    unquantized += [MC.block_pattern(sites[d.name]) for d in decisions
                    if d.action != "quantized" and sites[d.name].spec.ckpt_projs is not None]
    L.scheme_to_args(r.weight)          # unsupported schemes fail before anything is read
    if r.act is not None:
        L.scheme_to_args(static_scheme(r.act) if "S" in streams else r.act)
    ckpt, reads = _read_plans(model, in_dir)
    blist = model.model.layers
    return LayerwisePlan(
        recipe=r, steps=steps, streams=streams, calib=calib, in_dir=in_dir, cfg=cfg, config=config, model=model,
        summary=summary, experts=decisions, found=found, sites=sites, renamed=renamed, unquantized=unquantized,
        ckpt=ckpt, reads=reads, own={n for n in ckpt.files if n.startswith(LAYERS + ".")},
        keep_fp32=[_fp32_tensors(model, dtype, blist[i], f"{LAYERS}.{i}.") for i in range(len(blist))])


def _check_steps(r: Recipe, steps: list) -> frozenset:
    """The activation streams the steps read; steps not available layer by layer refused by name."""
    other = [type(s).__name__ for s in steps if not isinstance(s, Step) or s.stream is None]
    if other:
        raise ValueError(f"steps: {', '.join(other)} not available layer by layer (the steps it runs: SmoothQuant, "
                         "StaticScales, GPTQ); quantize the whole model for them")
    streams = frozenset(s.stream for s in steps)
    if "S" in streams and r.act is None:
        raise ValueError(f"static_scales needs a recipe with activation quantization; {r.name} is weight-only")
    return streams


def _meta_model(transformers, in_dir: Path) -> tuple[dict, object, str, torch.nn.Module]:
    """(config.json as a dict, its transformers config, its architecture, the model on the meta device)."""
    raw = read_json(in_dir / "config.json", "the model config")
    if "quantization_config" in raw:
        raise ValueError(f"{in_dir} is already quantized (config.json has a quantization_config); "
                         "give the float checkpoint")
    cfg = config_dict(raw)
    arch = (cfg.get("architectures") or [None])[0]
    if arch is None or not hasattr(transformers, arch):
        raise ValueError(f"config.json names architecture {arch!r}, which transformers does not have")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = getattr(transformers, arch)(config).eval()
    return cfg, config, arch, model


def _check_family(arch: str, model: torch.nn.Module, config, streams: frozenset) -> dict:
    """The experts modules of `model` (class `arch`: lowbit.archs.experts.find_experts); a family, a
    layout or an embedding this path does not reproduce is refused by name."""
    # experts first: a family outside the list below is refused by name (a MoE family is not in
    # the dense decoder map either)
    experts = find_experts(model)       # fused experts the map does not know are refused by name
    moe = sorted({s.family for s in experts.values()})
    if moe:
        family = moe[0]
        other = [f for f in moe if f not in MOE_FAMILIES]
        if other:
            raise NotImplementedError(
                f"{arch}: layer-by-layer quantization does not support {other[0]} experts "
                f"({next(n for n, s in experts.items() if s.family == other[0])}, ...): it covers the families "
                f"{', '.join(MOE_FAMILIES)} (per-expert checkpoint names it maps, one attention mask for every "
                "layer); quantize the whole model instead (lowbit quantize without --sequential, or "
                "lowbit.pipelines.quantize_model + save_compressed)")
        if "F" in streams:
            refuse_experts(model, "SmoothQuant", "lowbit.algorithms.experts_fold.smooth_experts folds it into the "
                           "experts' down side on a whole model (lowbit quantize --smoothquant without --sequential); "
                           "the layer-by-layer path does not run it yet.")
        if "S" in streams:
            raise NotImplementedError("static_scales: static activation scales are not supported for MoE experts "
                                      f"({next(iter(experts))}, ...), as in quantize_model; use a dynamic recipe")
        if getattr(config, "layer_types", None) and len(set(config.layer_types)) > 1:
            raise NotImplementedError(f"{arch}: its layers mix attention types {sorted(set(config.layer_types))}; "
                                      "layer-by-layer quantization passes every layer the first one's mask")
        blocks = decoder_blocks(model)      # the experts map stands for the decoder map's family check
        layout = blocks is not None and blocks[0] == LAYERS and hasattr(getattr(model, "model", None),
                                                                        "embed_tokens")
    else:
        fam = decoder_for(model)            # a family not in lowbit.archs.decoders is refused by name
        family = fam.family
        layout = fam.layers == LAYERS and fam.embed == "model.embed_tokens"
    inner = getattr(model, "model", None)
    if not layout or inner is None or not hasattr(inner, "rotary_emb"):
        raise NotImplementedError(f"{arch}: layer-by-layer quantization knows the Llama layout (model.embed_tokens, "
                                  "model.layers, model.norm, model.rotary_emb); quantize it whole instead")
    built = [f"model.embed_tokens.{n}" for n, _ in inner.embed_tokens.named_buffers()]
    if built:      # e.g. Gemma's embed_scale: set at construction, on the meta device here
        raise NotImplementedError(f"{family}: layer-by-layer quantization rebuilds the embedding from its "
                                  f"weight alone, but {built} are set at construction; quantize it whole instead")
    return experts


def _check_storage(r: Recipe, summary: QuantSummary, exp_quantized: list) -> None:
    """Refuse what the layers cannot quantize or compressed-tensors cannot store: Linears outside
    the decoder layers, weights whose in_features the group does not divide, per-expert blocks
    straddling gate and up."""
    outside = [d.name for d in summary.quantized + exp_quantized if not d.name.startswith(LAYERS + ".")]
    if outside:
        raise NotImplementedError(f"Linears outside the decoder layers would be quantized ({outside[:3]}): the "
                                  "layer-by-layer path keeps them in high precision; ignore=[...] them")
    short = [f"{d.name} {list(d.shape)}" for d in summary.quantized if d.shape[1] % summary.recipe_of(d).weight.k_width]
    short += [f"{d.name} (E, 2I, H = {d.shape})" for d in exp_quantized
              if d.shape[2] % summary.recipes[d.recipe].weight.k_width or
              (d.shape[1] // 2) % summary.recipes[d.recipe].weight.k_width]
    # save_compressed's check of per-expert storage, before any layer is read (a rank that failed
    # it alone, later, would leave the others waiting in a collective)
    for d in exp_quantized:
        w = summary.recipes[d.recipe].weight
        if w.strategy == "block" and (d.shape[1] // 2) % w.block_size[0]:
            raise ValueError(f"{d.name}: {w} blocks of {w.block_size[0]} rows straddle gate and up (I = "
                             f"{d.shape[1] // 2}); a per-expert checkpoint needs I to be a multiple of the block rows")
    if short:
        raise ValueError(f"{len(short)} weight(s) have an in_features that {r.name}'s group does not divide, which "
                         f"compressed-tensors cannot store: {', '.join(short[:3])}; ignore=[...] them or choose a "
                         "smaller group")


def _read_plans(model: torch.nn.Module, in_dir: Path) -> tuple[layer_loader.Checkpoint, list]:
    """The open checkpoint and each layer's read plan: every layer's tensors found, with the shapes
    config.json's model has (the checkpoint is closed again if one is not)."""
    world = distributed.world_size()
    ckpt = layer_loader.Checkpoint(in_dir)
    blist = model.model.layers
    try:
        sources = layer_loader.model_sources(model, ckpt)
        return ckpt, [layer_loader.plan(blist[i], f"{LAYERS}.{i}.", ckpt, world, sources) for i in range(len(blist))]
    except BaseException:
        ckpt.close()
        raise


def _fp32_tensors(model: torch.nn.Module, dtype: torch.dtype, layer: torch.nn.Module, prefix: str) -> set[str]:
    """The tensors of `layer` (names relative to it) that transformers keeps in float32 when it
    loads the model in `dtype` (the model's _keep_in_fp32_modules(_strict) plan, as
    from_pretrained matches it: e.g. DeepSeek-V3's router weight and e_score_correction_bias
    under bf16), so that the layer computes and stores what the whole-model path does."""
    get = getattr(model, "_get_dtype_plan", None)
    pats = [re.compile(p.replace("*", ".*")) for p, d in (get(dtype) if get is not None else {}).items()
            if d == torch.float32]
    return {n for n in layer_loader.tensors(layer) if any(p.search(prefix + n) for p in pats)}
