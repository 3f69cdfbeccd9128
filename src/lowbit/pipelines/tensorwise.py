"""Quantize a (sharded) safetensors checkpoint directory tensor by tensor.

Models larger than the machine's memory are never loaded: each tensor is read from its
shard on its own (lowbit.io.st_format.TensorReader, no memory map), quantized if it is a
Linear weight the recipe covers, written straight to the output shard on disk, and
dropped. Peak memory is therefore the largest tensor times a small factor (the float32
copy and quantize's temporaries) plus a constant; tests/pipelines/test_sharded.py measures it. The
output is the compressed-tensors checkpoint save_compressed writes (config.json with
quantization_config, shards + index, lowbit.json), written atomically.

Which tensors are Linear weights comes from the architecture: with a config.json naming
a transformers architecture, the model is built on the meta device (no memory) and its
nn.Linear modules are listed, with each MoE expert's projections as the family's checkpoints
name them (``<block>.experts.<e>.<gate|up|down>``: they are per-expert Linears there, quantized
like any other; the routers stay in high precision). Without one, pass ``targets`` (patterns
naming the layers).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from lowbit.archs.experts import find_experts
from lowbit.io import ct_layout as L
from lowbit.pipelines.checkpoint import (atomic_dir, build_quantization_config, config_dict, read_json,
                                          sidecar_record, write_metadata, DEFAULT_SHARD_BYTES)
from lowbit.io.st_format import CheckpointError, ShardedWriter, TensorReader, checkpoint_files, read_header
from lowbit.pipelines import moe_checkpoint as MC
from lowbit.pipelines.moe import router_names
from lowbit.quantize import quantize
from lowbit.recipes.plan import check_patterns, kept_by_default, match
from lowbit.recipes.presets import get_recipe
from lowbit.progress import progress_bar

# Files of a checkpoint directory that are replaced, not copied.
_REPLACED = ("config.json", "model.safetensors.index.json", "lowbit.json")


def linear_names_from_config(cfg: dict) -> set[str]:
    """Module names of every nn.Linear in the transformers model that config.json describes,
    found by building the model on the meta device (no weights are allocated), and for a MoE
    family each expert's projection under its checkpoint name (lowbit.pipelines.moe_checkpoint:
    ``<block>.experts.<e>.<gate|up|down>``, the per-expert Linears of its checkpoints)."""
    linears, experts, _ = checkpoint_layout(cfg)
    return linears | experts


def checkpoint_layout(cfg: dict) -> tuple[set[str], set[str], list[str]]:
    """(Linear names, per-expert layer names, router names) of the architecture in config.json,
    all as its checkpoints name them. Raises for a MoE family whose checkpoints keep the
    experts fused (they cannot be quantized tensor by tensor into per-expert tensors)."""
    import transformers
    arch = (cfg.get("architectures") or [None])[0]
    if arch is None or not hasattr(transformers, arch):
        raise CheckpointError(f"config.json names architecture {arch!r}, which transformers does not have; "
                              "pass targets=[...] naming the Linear layers instead")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = getattr(transformers, arch)(config)
    find_experts(model)                   # an unknown fused-experts module is refused by name
    sites = MC.experts_sites(model)
    fused = [s.name for s in sites.values() if s.spec.ckpt_projs is None]
    if fused:
        raise NotImplementedError(f"{arch}: its checkpoints keep the experts fused ({fused[0]}, ...), which "
                                  "tensor-wise quantization cannot split per expert; load the model and use "
                                  "lowbit.pipelines.quantize_model + save_compressed instead")
    table = MC.renames(sites)
    linears = {MC.rename(n, table) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    experts = {s.layer(e, p) for s in sites.values()
               for e in range(int(getattr(s.module, s.spec.gate_up).shape[0])) for p in range(3)}
    routers = [MC.rename(n, table) for n in router_names(model, {n: s.spec for n, s in sites.items()})]
    return linears - experts, experts, routers


def copy_side_files(in_dir: Path, out_dir: Path) -> None:
    """Copy what a quantized checkpoint keeps of the input directory unchanged: the tokenizer,
    generation config, licence, ... (not the tensors, config.json, the index or lowbit.json)."""
    for f in os.listdir(in_dir):
        src = Path(in_dir) / f
        if src.is_file() and not f.endswith(".safetensors") and f not in _REPLACED:
            shutil.copy2(src, Path(out_dir) / f)


def _check_shapes(todo: set, files: dict, scheme) -> None:
    """Every weight to quantize must be 2-D with K a multiple of the scheme's group/block
    width (compressed-tensors cannot store a short last group); checked on the headers,
    before any tensor is read."""
    width = scheme.k_width
    headers: dict[str, dict] = {}
    bad = []
    for layer in sorted(todo):
        path = files[f"{layer}.weight"]
        if path not in headers:
            headers[path] = read_header(path)[0]
        shape = headers[path][f"{layer}.weight"][1]
        if len(shape) != 2 or shape[1] % width:
            bad.append(f"{layer} {list(shape)}")
    if bad:
        raise ValueError(f"{len(bad)} weight(s) cannot be quantized by {scheme} into compressed-tensors "
                         f"(2-D with K a multiple of {width} needed): {', '.join(bad[:4])}"
                         f"{' ...' if len(bad) > 4 else ''}; ignore=[...] them or choose a smaller group")


def quantize_checkpoint(in_dir: str | os.PathLike, out_dir: str | os.PathLike, recipe, *, ignore=None,
                        targets=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                        progress: bool = False) -> dict:
    """Quantize the Linear weights of the safetensors checkpoint in `in_dir` with `recipe`
    (a lowbit recipe name or Recipe) and write a compressed-tensors checkpoint to `out_dir`.

    ignore:  patterns (globs, or ``re:`` regexes) of Linear layers to keep in high precision;
             ``lm_head`` is always kept. A pattern matching no Linear is an error.
    targets: patterns of the layers to quantize, for checkpoints without a config.json.
    Returns a summary dict: quantized / kept layer names, input and output bytes, shards.
    Every input file is validated before anything is written; NaN/Inf in a weight raises
    and leaves no output directory.
    """
    recipe = get_recipe(recipe)
    if recipe.act is not None and not recipe.act.dynamic:
        raise ValueError(f"recipe {recipe.name} has static activation scales, which need calibration on a "
                         "loaded model; use lowbit.pipelines.quantize_model + save_compressed for it")
    in_dir = Path(in_dir)
    experts, routers = set(), []
    files = checkpoint_files(in_dir)  # validates every header (truncation, index coverage)
    cfg_path = in_dir / "config.json"
    cfg = {}
    if cfg_path.exists():
        raw_cfg = read_json(cfg_path, "the model config")
        if "quantization_config" in raw_cfg:
            raise ValueError(f"{in_dir} is already quantized (config.json has a quantization_config); "
                             "quantize the original float checkpoint")
        cfg = config_dict(raw_cfg)
    if targets is not None:
        candidates = {n[: -len(".weight")] for n in files if n.endswith(".weight")}
        linears = {n for n in candidates if any(match(t, n) for t in targets)}
        if not linears:
            raise ValueError(f"targets={list(targets)} match no '<name>.weight' tensor in {in_dir}")
    elif cfg:
        linears, experts, routers = checkpoint_layout(cfg)
        linears |= experts
    else:
        raise ValueError(f"{in_dir} has no config.json to tell which tensors are Linear weights; "
                         "pass targets=[...] (e.g. ['re:.*_proj$'])")
    ignore = list(ignore or [])
    check_patterns(ignore, linears)
    keep = {n for n in linears if kept_by_default(n) or any(match(p, n) for p in ignore)}
    absent = sorted(n for n in experts if n not in keep and f"{n}.weight" not in files)
    if absent:     # e.g. experts stored fused under the module's names: they would be copied in float
        raise ValueError(f"{in_dir} has no per-expert weight {absent[0]}.weight ({len(absent)} expert projections "
                         "absent); tensor-wise quantization reads the experts one Linear per expert, as the "
                         "family's checkpoints (and transformers' save_pretrained) store them")
    todo = {n for n in linears if n not in keep and f"{n}.weight" in files}
    if not todo:
        raise ValueError(f"no Linear weight left to quantize in {in_dir} (all ignored or absent)")
    if todo & experts and (recipe.weight.strategy == "tensor" or recipe.weight.two_level):
        raise ValueError(f"recipe {recipe.name}: one weight scale per tensor is one per expert in lowbit (gate and "
                         "up share it), but tensor by tensor gate and up would get one each; quantize the loaded "
                         "model (lowbit.pipelines.quantize_model + save_compressed) or ignore the experts")
    fmt = L.ct_format(recipe.weight, recipe.act)
    L.scheme_to_args(recipe.weight)  # unsupported schemes fail before anything is written
    if recipe.act is not None:
        L.scheme_to_args(recipe.act)

    by_file: dict[str, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    _check_shapes(todo, files, recipe.weight)
    summary = {"recipe": recipe.name, "quantized": sorted(todo), "kept": sorted(linears - todo),
               "bytes_in": sum(os.path.getsize(p) for p in by_file), "shards": []}
    total = sum(len(v) for v in by_file.values())

    def write(tmp: Path):
        bar = None
        if progress:
            bar = progress_bar(total=total, desc=f"quantize {recipe.name}", unit="tensor")
        writer = ShardedWriter(tmp, max_shard_bytes)
        layers = {}
        for path in sorted(by_file):
            with TensorReader(path) as reader:
                for name in by_file[path]:
                    t = reader.get(name)
                    layer = name[: -len(".weight")] if name.endswith(".weight") else None
                    if layer in todo:
                        w = t.float()
                        del t
                        if not torch.isfinite(w).all():
                            raise ValueError(f"{path}: {name} holds NaN/Inf values; fix the checkpoint "
                                             "before quantizing")
                        qt = quantize(w, recipe.weight)
                        del w
                        for k, v in L.qtensor_to_ct(qt, fmt).items():
                            writer.add(f"{layer}.{k}", v)
                        layers[layer] = sidecar_record(qt, recipe.act, fmt)
                        del qt
                    else:
                        writer.add(name, t)
                        del t
                    if bar is not None:
                        bar.update(1)
        summary["shards"] = writer.finish()
        if bar is not None:
            bar.close()
        out_cfg = dict(cfg)
        out_cfg["quantization_config"] = build_quantization_config(
            {n: (recipe.weight, recipe.act) for n in todo}, sorted((linears - todo) | set(routers)))
        write_metadata(tmp, out_cfg, recipe.name, layers)
        copy_side_files(in_dir, tmp)

    out = atomic_dir(Path(out_dir), overwrite, write)
    summary["out_dir"] = str(out)
    summary["bytes_out"] = sum(os.path.getsize(out / s) for s in summary["shards"])
    return summary
