"""Model checkpoints in the compressed-tensors format (what vLLM and transformers load).

A checkpoint directory holds:
- ``config.json``: the model's config with ``quantization_config`` = {quant_method
  "compressed-tensors", format, quantization_status "compressed", config_groups (targets,
  weights, input_activations, format), ignore};
- ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``:
  every quantized layer's tensors in compressed-tensors' names and layouts (see
  lowbit.io.ct_layout) and every other tensor (embeddings, norms, biases) as it was;
- ``lowbit.json``: lowbit's own record of each layer's exact scheme (e.g. the e8m0 scale
  rounding rule, which compressed-tensors does not store) and NVFP4's exact tensor scale, so
  that ``load_compressed`` gives back bit-identical QTensors. Other tools ignore it.

Writes are atomic: everything goes to a temporary directory next to ``out_dir`` that is
moved into place only when complete, so an error never leaves a half-written checkpoint, and
only files lowbit wrote are ever replaced (lowbit.io.outdir).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.archs.decoders import sibling_groups
from lowbit.io import ct_layout as L
from lowbit.io.outdir import staged
from lowbit.io.st_format import CheckpointError, ShardedWriter, TensorReader, checkpoint_files, loads_strict
from lowbit.nn.experts import QuantExperts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.nn.shared_input import GROUPS, prepare_model
from lowbit.pipelines import moe_checkpoint as MC
from lowbit.pipelines.moe import router_names
from lowbit.pipelines.quantize_model import quantize_model, untie_embeddings
from lowbit.quantize import QTensor
from lowbit.recipes.plan import kept_by_default
from lowbit.scheme import QuantScheme

SIDECAR = "lowbit.json"
SIDECAR_VERSION = 1
DEFAULT_SHARD_BYTES = 5 << 30  # Hugging Face's default shard size


# ---------------------------------------------------------------- quantization_config
def _group_key(weight: QuantScheme, act: QuantScheme | None) -> tuple:
    return (weight, act, L.ct_format(weight, act))


def build_quantization_config(layers: dict[str, tuple[QuantScheme, QuantScheme | None]],
                              unquantized_linears: list[str], targets: dict[str, str] | None = None) -> dict:
    """The ``quantization_config`` dict for layers {name: (weight scheme, act scheme)}.

    One scheme for all -> targets ["Linear"] with every unquantized Linear in ``ignore``;
    several -> one config group per scheme pair, targeting its layers by exact name (or by
    targets[name], e.g. one pattern for all experts of a block), and format "mixed-precision"
    when their formats differ. A quantized LM head is always named in its group's targets
    (tools keep `lm_head` in high precision unless a config names it).
    """
    targets = targets or {}
    if not layers:
        raise ValueError("no quantized layers: a compressed-tensors checkpoint needs at least one")
    groups: dict[tuple, list[str]] = {}
    for name, (w, a) in layers.items():
        groups.setdefault(_group_key(w, a), []).append(name)
    single = len(groups) == 1
    config_groups = {}
    for i, ((w, a, fmt), names) in enumerate(groups.items()):
        config_groups[f"group_{i}"] = {
            "targets": (["Linear"] + sorted(n for n in names if kept_by_default(n)) if single
                        else sorted({targets.get(n, n) for n in names})),
            "weights": L.scheme_to_args(w),
            "input_activations": None if a is None else L.scheme_to_args(a),
            "output_activations": None,
            "format": fmt,
        }
    formats = {k[2] for k in groups}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(unquantized_linears),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def sidecar_record(qt: QTensor, act: QuantScheme | None, fmt: str) -> dict:
    """lowbit.json's entry for one layer: exact schemes and NVFP4's exact tensor scale."""
    g = qt.global_scale
    return {"weight": qt.scheme.to_dict(), "act": None if act is None else act.to_dict(), "format": fmt,
            "global_scale": None if g is None else float(g).hex()}


def write_metadata(directory: Path, cfg: dict, recipe_name, layers: dict) -> None:
    """config.json (with quantization_config already in cfg) and lowbit.json."""
    with open(Path(directory) / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(Path(directory) / SIDECAR, "w") as f:
        json.dump({"format_version": SIDECAR_VERSION, "recipe": recipe_name, "layers": layers},
                  f, indent=1, sort_keys=True)


# ---------------------------------------------------------------- atomic directory
def atomic_dir(out_dir: Path, overwrite: bool, write) -> Path:
    """Run write(staging_dir) and make its files out_dir's (lowbit.io.outdir's rules: only
    lowbit's own files are ever replaced). A non-empty out_dir needs overwrite=True."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"out_dir {out_dir} exists and is not empty; choose a new directory "
                              "or pass overwrite=True")
    with staged(out_dir, overwrite, what="out_dir") as tmp:
        write(tmp)
    return out_dir


def config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
    else:
        raise TypeError(f"config must be a transformers PretrainedConfig or a dict, got {type(config).__name__}")
    d.pop("quantization_config", None)  # e.g. GGUF flags of the source model: replaced by ours
    return d


# ---------------------------------------------------------------- save
def describe_qlayer(name: str, m) -> tuple[str, tuple, dict]:
    """(ct format, (weight scheme, act scheme), lowbit.json record) of one QuantLinear, after
    every check that can fail on the scheme side (so nothing is written for a layer that cannot
    be stored)."""
    if m.act_scheme is not None and not m.act_scheme.dynamic and m.act_static_scale is None:
        raise ValueError(f"{name}: static activation scheme without act_static_scale")
    return describe_qtensor(name, m.weight_q, m.weight_scheme, m.act_scheme)


def describe_qtensor(name: str, qt: QTensor, weight: QuantScheme, act: QuantScheme | None) -> tuple[str, tuple, dict]:
    """describe_qlayer for one quantized weight (a Linear's, or one expert's projection)."""
    fmt = L.ct_format(weight, act)
    if qt.scheme != weight:
        raise ValueError(f"{name}: weight_q was quantized with {qt.scheme} but the layer says {weight}")
    try:
        L.check_encodable(qt)
    except (ValueError, NotImplementedError) as e:
        raise type(e)(f"layer {name}: {e}; keep it in high precision (ignore=[...]) or choose a "
                      "scheme compressed-tensors can store") from e
    if act is not None:
        L.scheme_to_args(act)
    return fmt, (weight, act), sidecar_record(qt, act, fmt)


def save_compressed(model: torch.nn.Module, out_dir: str | os.PathLike, recipe=None, *, config=None,
                    tokenizer=None, ignore=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    overwrite: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a compressed-tensors checkpoint directory; returns its path.

    model:     a model whose Linear layers are lowbit QuantLinears (lowbit.pipelines.quantize_model),
               or a float model together with `recipe`, which is then quantized IN PLACE with
               quantize_model(model, recipe, ignore=ignore).
    config:    the model's config (transformers PretrainedConfig or dict); default
               ``model.config``. Pass ``config={}`` for a model without one (the directory is
               then not loadable by transformers, only by load_compressed).
    tokenizer: saved alongside (``tokenizer.save_pretrained``) when given.
    max_shard_bytes: safetensors shard size (bytes of tensor data per file).
    dtype:     the dtype every float tensor kept in high precision (embeddings, norms, biases,
               unquantized Linears) is stored in, and config.json's dtype; None keeps each
               tensor's own (and the config's). Quantized codes and scales are never converted.
    Raises ValueError / UnsupportedScheme before anything is written when a layer's scheme
    has no compressed-tensors encoding.
    """

    def quantized():
        return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantExperts))}
    qlayers = quantized()
    if not qlayers:
        if recipe is None:
            raise ValueError("model has no QuantLinear layers: quantize it first (lowbit.pipelines.quantize_model) "
                             "or pass recipe=... to quantize it here")
        quantize_model(model, recipe, ignore=ignore)
        qlayers = quantized()
    if config is None:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(f"{type(model).__name__} has no .config: pass config=... (a transformers "
                             "PretrainedConfig or dict; {} writes only the quantization config)")
    cfg = config_dict(config)
    if cfg and not cfg.get("architectures") and hasattr(model, "config"):
        cfg["architectures"] = [type(model).__name__]  # what save_pretrained records
    recipe_name = getattr(recipe, "name", recipe)

    # Everything that can fail on the scheme side is checked before any file is written;
    # the compressed tensors themselves are made one layer at a time while writing.
    sites = MC.experts_sites(model)
    table = MC.renames(sites)
    layer_schemes, formats, sidecar_layers, targets = {}, {}, {}, {}
    for name, m in qlayers.items():
        if isinstance(m, QuantLinear):
            key = MC.rename(name, table)
            formats[name], layer_schemes[key], sidecar_layers[key] = describe_qlayer(key, m)
            continue
        MC.check_savable(sites[name], cfg)
        for lname, qt in MC.expert_qtensors(sites[name]):
            formats[name], layer_schemes[lname], sidecar_layers[lname] = describe_qtensor(
                lname, qt, m.weight_scheme, m.act_scheme)
            targets[lname] = MC.block_pattern(sites[name])
    unquantized = [MC.rename(n, table) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and not isinstance(m, QuantLinear)]
    unquantized += [MC.rename(n, table) for n in router_names(model, {n: s.spec for n, s in sites.items()})]
    unquantized += [MC.block_pattern(s) for s in sites.values()     # float experts, per expert in the files
                    if not s.quantized and s.spec.ckpt_projs is not None]
    qconfig = build_quantization_config(layer_schemes, sorted(set(unquantized)), targets)
    kv = getattr(model, "lowbit_kv_cache", None)     # lowbit.nn.kv_cache.attach_kv_cache: scales are buffers
    if kv is not None:
        qconfig["kv_cache_scheme"] = kv.scheme.to_ct_args()
    cfg["quantization_config"] = qconfig
    if dtype is not None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype}: the high-precision tensors need a float dtype (torch.bfloat16, ...)")
        set_config_dtype(cfg, dtype)

    def write(tmp: Path):
        writer = ShardedWriter(tmp, max_shard_bytes)
        seen: set[int] = set()
        for name, t in module_tensors(model, formats, seen, float_dtype=dtype, experts=sites):
            writer.add(MC.rename(name, table), t)
        writer.finish()
        write_metadata(tmp, cfg, recipe_name, sidecar_layers)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return atomic_dir(Path(out_dir), overwrite, write)


def set_config_dtype(cfg: dict, dtype: torch.dtype) -> None:
    """config.json's record of the float dtype: `dtype` (transformers 5) and the older
    `torch_dtype` where the config had it."""
    name = str(dtype).replace("torch.", "")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name


def module_tensors(root: torch.nn.Module, formats: dict[str, str], seen: set[int], prefix: str = "",
                   defer_host: bool = False, float_dtype: torch.dtype | None = None, experts: dict | None = None):
    """(name, tensor) of everything save_compressed stores for `root` and its submodules, names
    prefixed by `prefix`: each QuantLinear's compressed-tensors tensors (`formats`: its ct format
    by full module name) + bias + input_scale; every other parameter and persistent buffer as it
    is. `prefix`: root's own module name ("" for a model). `seen` holds ids of tensors already given (a tied weight is stored once).
    defer_host: a QuantLinear whose codes are on the host (e.g. W4A16's exact twin) gives
    (prefix, callable) instead of its weight tensors; the callable returns them (for int4 that is
    packing into int32 words on the CPU, which a writer thread can do: expand_deferred).
    float_dtype: the dtype the float tensors kept in high precision (parameters, persistent
    buffers, a QuantLinear's bias) are given in; None: as they are.
    experts: lowbit.pipelines.moe_checkpoint.experts_sites(root) by full name: those modules are
    written one Linear per expert and projection, under their checkpoint names."""
    def hp(t):
        return t if float_dtype is None or not t.is_floating_point() else t.to(float_dtype)
    experts = experts or {}
    for mname, m in root.named_modules():
        full = f"{prefix}.{mname}" if prefix and mname else (prefix or mname)
        pre = f"{full}." if full else ""
        site = experts.get(full)
        if site is not None and site.quantized:
            for lname, qt in MC.expert_qtensors(site):
                yield from ((f"{lname}.{k}", v) for k, v in L.qtensor_to_ct(qt, formats[full]).items())
            continue
        if site is not None and site.spec.ckpt_projs is not None:
            yield from ((n, hp(w)) for n, w in MC.float_expert_weights(site))
            continue
        if isinstance(m, QuantLinear):
            if defer_host and m.weight_q.codes.device.type == "cpu":
                yield pre, lambda qt=m.weight_q, fmt=formats[full], pre=pre: [
                    (pre + k, v) for k, v in L.qtensor_to_ct(qt, fmt).items()]
            else:
                yield from ((pre + k, v) for k, v in L.qtensor_to_ct(m.weight_q, formats[full]).items())
            if m.bias is not None:
                yield pre + "bias", hp(m.bias.detach())
            if m.act_static_scale is not None:
                yield pre + "input_scale", m.act_static_scale.detach().float().reshape(1)
            continue
        tensors = [(k, p) for k, p in m._parameters.items() if p is not None]
        tensors += [(k, b) for k, b in m._buffers.items()
                    if b is not None and k not in m._non_persistent_buffers_set]
        for k, t in tensors:
            if id(t) in seen:  # a tied weight (lm_head = embed_tokens): stored once
                continue
            seen.add(id(t))
            yield pre + k, hp(t.detach())


def expand_deferred(items):
    """The (name, tensor) pairs of module_tensors(..., defer_host=True)'s items, in order: each
    deferred QuantLinear's tensors made where this runs."""
    for n, t in items:
        if callable(t):
            yield from t()
        else:
            yield n, t


# ---------------------------------------------------------------- load
@dataclass
class CompressedCheckpoint:
    """What load_compressed read. Layer names are module names (``model.layers.0.mlp.up_proj``).

    qtensors:     {layer: QTensor of its weight [N, K]}, bit-identical to what was saved.
    act_schemes:  {layer: activation QuantScheme or None (weight-only)}.
    act_static_scales: {layer: float32 [1, 1]} for static activation schemes.
    tensors:      every other tensor by its full name (embeddings, norms, biases, ...).
    config:       config.json as a dict; quantization_config is its compressed-tensors part.
    recipe:       the lowbit recipe name recorded at save time, or None.
    """
    qtensors: dict[str, QTensor]
    act_schemes: dict[str, QuantScheme | None]
    act_static_scales: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    config: dict
    recipe: str | None = None
    formats: dict[str, str] = field(default_factory=dict)
    kv_cache: object = None       # lowbit.nn.kv_cache.KVCacheQuant from kv_cache_scheme + k_scale / v_scale

    @property
    def quantization_config(self) -> dict:
        return self.config["quantization_config"]

    def quant_linears(self, backend: str = "auto", skip=()) -> dict:
        """{layer: lowbit.nn.QuantLinear} rebuilt from the stored codes and scales (layers in
        `skip`, e.g. the per-expert ones to_model stacks into QuantExperts, left out)."""
        return {n: QuantLinear(qt, qt.scheme, self.act_schemes[n], bias=self.tensors.get(f"{n}.bias"),
                               act_static_scale=self.act_static_scales.get(n), backend=backend)
                for n, qt in self.qtensors.items() if n not in skip}

    def to_model(self, backend: str = "auto", *, device=None, dtype: torch.dtype | None = None,
                 share_inputs: bool = True) -> torch.nn.Module:
        """The transformers model of config.json with its quantized layers as QuantLinears.
        Needs transformers; raises if a parameter is missing.

        device / dtype: where the model runs and the dtype of everything that is not
        quantized (default: the CPU and float32, the exact path). On CUDA with bf16 / fp16 the
        quantized layers take the prepared fast path (lowbit.ops.prepared); share_inputs merges
        q/k/v and gate/up so each activation is quantized once (lowbit.nn.shared_input)."""
        import transformers
        cfg = {k: v for k, v in self.config.items() if k != "quantization_config"}
        arch = (cfg.get("architectures") or [None])[0]
        if arch is None or not hasattr(transformers, arch):
            raise CheckpointError(f"config.json names architecture {arch!r}, which transformers does not have")
        config = transformers.AutoConfig.for_model(**cfg)
        model = getattr(transformers, arch)(config).float().eval()
        experts, fused, used, table = MC.assemble(model, self.qtensors, self.act_schemes, self.tensors,
                                                  str(arch), backend, cfg)
        sites_ckpt = {s.ckpt for s in MC.experts_sites(model).values()}
        stray = MC.stray_expert_names([n for n in list(self.qtensors) + list(self.tensors) if n not in used],
                                      sites_ckpt)
        if stray:
            raise CheckpointError(f"checkpoint holds per-expert tensors of no experts module of {arch}: {stray[:3]}")
        back = {v: k for k, v in table.items()}     # checkpoint block names -> the model's
        qls = {MC.rename(n, back): ql for n, ql in self.quant_linears(backend, skip=used).items()}
        for name, ql in list(qls.items()) + list(experts.items()):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ql)
        dense = {MC.rename(k, back): v for k, v in self.tensors.items() if k not in used}
        dense = {k: v for k, v in dense.items() if not (k.rpartition(".")[0] in qls and k.endswith(".bias"))}
        dense.update(fused)
        missing, unexpected = model.load_state_dict(dense, strict=False)
        missing = [k for k in missing if k.rpartition(".")[0] not in qls and k.rpartition(".")[0] not in experts]
        if any(kept_by_default(n) for n in qls):   # a quantized LM head is its own weight, never the embedding
            untie_embeddings(model, [n for n in qls if kept_by_default(n)])
        elif getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
            missing = [k for k in missing if not k.endswith("lm_head.weight")]
        if missing or unexpected:
            raise CheckpointError(f"checkpoint does not fit {arch}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        groups = sibling_groups(model)
        model = prepare_model(model, device=device, dtype=dtype, share=share_inputs,
                              groups=GROUPS if groups is None else groups)
        if self.kv_cache is not None:
            from lowbit.nn.kv_cache import attach_kv_cache  # optional: transformers
            attach_kv_cache(model, self.kv_cache)
        return model


def read_json(path: Path, what: str) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path.parent} has no {path.name} ({what})")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file; the checkpoint is corrupt")
    try:
        with open(path, encoding="utf-8") as f:
            data = loads_strict(f.read())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object ({what})")
    return data


_ARG_TYPES = {"num_bits": int, "type": str, "strategy": str, "symmetric": bool, "observer": str,
              "scale_dtype": str, "zp_dtype": str}


def check_args_types(args, where: str, what: str) -> None:
    """A compressed-tensors QuantizationArgs dict (or null) with the JSON types the format has:
    a reader must not turn a string group size or a zero block into an arithmetic crash."""
    if args is None:
        return
    if not isinstance(args, dict):
        raise CheckpointError(f"{where}: {what} must be an object or null, got {type(args).__name__}")
    for k, t in _ARG_TYPES.items():
        v = args.get(k)
        if v is not None and (not isinstance(v, t) or (t is int and isinstance(v, bool))):
            raise CheckpointError(f"{where}: {what}.{k} must be a {t.__name__}, got {str(v)[:40]!r}")
    if args.get("num_bits") is not None and not 1 <= args["num_bits"] <= 64:
        raise CheckpointError(f"{where}: {what}.num_bits {args['num_bits']} is not a bit width")
    g = args.get("group_size")
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or (g < 1 and g != -1)):
        raise CheckpointError(f"{where}: {what}.group_size must be a positive integer, -1 or null, got {g!r}")
    b = args.get("block_structure")
    if b is not None and not (isinstance(b, list) and len(b) == 2 and all(isinstance(v, int) and not
                                                                         isinstance(v, bool) and v > 0 for v in b)):
        raise CheckpointError(f"{where}: {what}.block_structure must be [rows, cols] of positive integers, got {b!r}")
    if args.get("dynamic", False) not in (True, False, "local"):
        raise CheckpointError(f"{where}: {what}.dynamic must be true, false or \"local\", got {args['dynamic']!r}")


def check_qc_types(qc, where: str) -> tuple[dict, list[str]]:
    """Validate the JSON types of a quantization_config (every tool's, for reading and for
    `lowbit inspect`); returns (config_groups, ignore)."""
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: config.json has no quantization_config object; not a quantized checkpoint")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise CheckpointError(f"{where}: quantization_config.config_groups must map group names to objects")
    for gname, g in groups.items():
        str_list(g.get("targets"), where, f"config group {gname!r} targets")
        for k in ("weights", "input_activations", "output_activations"):
            check_args_types(g.get(k), where, f"config group {gname!r} {k}")
        if not isinstance(g.get("format"), (str, type(None))):
            raise CheckpointError(f"{where}: config group {gname!r} format must be a string")
    check_args_types(qc.get("kv_cache_scheme"), where, "kv_cache_scheme")
    if not isinstance(qc.get("format"), (str, type(None))):
        raise CheckpointError(f"{where}: quantization_config.format must be a string")
    return groups, str_list(qc.get("ignore"), where, "quantization_config.ignore")


def str_list(value, where: str, what: str) -> list[str]:
    """A JSON list of layer names / patterns (``re:`` patterns compiled), or [] for null."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise CheckpointError(f"{where}: {what} must be a list of layer names / patterns, got {str(value)[:100]}")
    for v in value:
        if v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as e:
                raise CheckpointError(f"{where}: {what} pattern {v!r} is not a valid regular expression ({e})") from e
    return value


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def _normalized_args(args: dict | None) -> dict | None:
    """compressed-tensors args with its defaults filled, for comparing two descriptions."""
    if args is None:
        return None
    s = L.args_to_scheme(args)
    return L.scheme_to_args(s)


def parse_quantization_config(config: dict, where: str) -> tuple[dict, list[str]]:
    """Validate a config.json's quantization_config; returns (groups, ignore) with groups
    {group name: (targets, weight scheme, act scheme or None, format)}."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: config.json has no quantization_config; not a quantized checkpoint")
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quantization_config.quant_method is {qc.get('quant_method')!r}, "
                              "expected 'compressed-tensors'")
    groups_raw, ignore = check_qc_types(qc, where)
    if not groups_raw:
        raise CheckpointError(f"{where}: quantization_config has no config_groups")
    top_fmt = qc.get("format")
    groups = {}
    for gname, g in groups_raw.items():
        if not g.get("targets") or g.get("weights") is None:
            raise CheckpointError(f"{where}: config group {gname!r} needs 'targets' and 'weights'")
        fmt = g.get("format") or top_fmt
        if fmt in (None, "mixed-precision", "dense"):
            raise CheckpointError(f"{where}: config group {gname!r} has no usable format (top-level format is "
                                  f"{top_fmt!r}); mixed-precision checkpoints name each group's format")
        try:
            w = L.args_to_scheme(g["weights"])
            a = None if g.get("input_activations") is None else L.args_to_scheme(g["input_activations"])
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{where}: config group {gname!r} has invalid quantization args: {e}") from e
        groups[gname] = (list(g["targets"]), w, a, fmt)
    return groups, list(ignore)


def _tensor_scale(text, where: str) -> torch.Tensor:
    """lowbit.json's exact NVFP4 tensor scale (float.hex text): finite and positive."""
    try:
        v = float.fromhex(text)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: global_scale {str(text)[:40]!r} is not a float.hex() string") from e
    if not (v > 0 and v != float("inf")):
        raise CheckpointError(f"{where}: global_scale {text!r} is not a finite positive number; the file is corrupt")
    return torch.tensor(v, dtype=torch.float32)


def load_compressed(path: str | os.PathLike) -> CompressedCheckpoint:
    """Read a compressed-tensors checkpoint directory written by lowbit (exactly) or by
    another tool (schemes derived from quantization_config).

    Every file is validated before anything is returned: a missing or inconsistent
    config.json / lowbit.json / index, a truncated safetensors file, a quantized layer no
    config group describes or a tensor with the wrong shape or dtype raises CheckpointError
    (a ValueError) naming the file or layer and the fix.
    """
    d = Path(path)
    config = read_json(d / "config.json", "the model config with quantization_config")
    groups, ignore = parse_quantization_config(config, str(d))
    files = checkpoint_files(d)

    # Quantized layers are those carrying a weight_scale tensor.
    qnames = sorted(n[: -len(".weight_scale")] for n in files if n.endswith(".weight_scale"))
    if not qnames:
        raise CheckpointError(f"{d}: config.json declares quantization but no tensor is named *.weight_scale")
    assign: dict[str, str] = {}
    for layer in qnames:
        if any(_matches(t, layer) for t in ignore):
            raise CheckpointError(f"{d}: layer {layer} is quantized but listed in quantization_config.ignore")
        exact = [g for g, (ts, *_rest) in groups.items() if any(_matches(t, layer) for t in ts)]
        generic = [g for g, (ts, *_rest) in groups.items() if "Linear" in ts]
        chosen = exact or generic
        if not chosen:
            raise CheckpointError(f"{d}: layer {layer} has quantized tensors but no config group targets it")
        assign[layer] = chosen[0]

    side_path = d / SIDECAR
    sidecar = read_json(side_path, "lowbit's record") if side_path.exists() else None
    if sidecar is not None:
        if sidecar.get("format_version") != SIDECAR_VERSION:
            raise CheckpointError(f"{side_path}: format_version {sidecar.get('format_version')!r}, this lowbit "
                                  f"reads {SIDECAR_VERSION}")
        side_layers = sidecar.get("layers") or {}
        if not isinstance(side_layers, dict) or not all(isinstance(r, dict) for r in side_layers.values()):
            raise CheckpointError(f"{side_path}: 'layers' must map layer names to records (objects)")
        if set(side_layers) != set(qnames):
            diff = sorted(set(side_layers) ^ set(qnames))[:5]
            raise CheckpointError(f"{side_path} and the safetensors files disagree on which layers are quantized "
                                  f"(e.g. {diff}); the directory mixes two checkpoints")

    # Read every tensor, one file at a time.
    by_file: dict[str, list[str]] = {}
    for name, fpath in files.items():
        by_file.setdefault(fpath, []).append(name)
    raw: dict[str, torch.Tensor] = {}
    for fpath, names in by_file.items():
        with TensorReader(fpath) as r:
            for n in names:
                raw[n] = r.get(n)

    qtensors, acts, statics, formats = {}, {}, {}, {}
    qset = set(qnames)
    for layer in qnames:
        _, w, a, fmt = groups[assign[layer]]
        gscale = None
        if sidecar is not None:
            rec = sidecar["layers"][layer]
            try:
                w_side = QuantScheme.from_dict(rec["weight"])
                a_side = None if rec.get("act") is None else QuantScheme.from_dict(rec["act"])
            except (ValueError, TypeError, KeyError) as e:
                raise CheckpointError(f"{side_path}: layer {layer} has an invalid scheme record: {e}") from e
            if (L.scheme_to_args(w_side) != L.scheme_to_args(w)
                    or (a_side is None) != (a is None)
                    or (a is not None and L.scheme_to_args(a_side) != L.scheme_to_args(a))
                    or rec.get("format") != fmt):
                raise CheckpointError(f"{d}: layer {layer}: {SIDECAR} says weight {w_side}, act {a_side}, format "
                                      f"{rec.get('format')} but config.json says weight {w}, act {a}, format {fmt}")
            w, a = w_side, a_side
            if rec.get("global_scale") is not None:
                gscale = _tensor_scale(rec["global_scale"], f"{side_path}: layer {layer}")
        local = {k[len(layer) + 1:]: raw.pop(k) for k in list(raw)
                 if k.startswith(layer + ".") and k[len(layer) + 1:] in L.WEIGHT_KEYS + L.ACT_KEYS}
        try:
            qt = L.ct_to_qtensor(local, w, fmt, global_scale=gscale, where=f"{d}: layer {layer}")
        except L.UnsupportedScheme as e:
            raise CheckpointError(f"{d}: layer {layer}: {e}") from e
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        except (RuntimeError, IndexError) as e:  # torch refusing a view/reshape of tensors that lie
            raise CheckpointError(f"{d}: layer {layer}: its tensors do not fit format {fmt} and scheme {w} ({e})") \
                from e
        if gscale is not None and "weight_global_scale" in local:
            stored = local["weight_global_scale"].to(torch.float32).reshape(())
            if not torch.equal(stored, (1.0 / gscale).reshape(())):
                raise CheckpointError(f"{d}: layer {layer}: weight_global_scale {float(stored)!r} is not 1 / the "
                                      f"recorded tensor scale {float(gscale)!r}; the files are out of step")
        qtensors[layer], acts[layer], formats[layer] = qt, a, fmt
        if a is not None and not a.dynamic:
            if "input_scale" not in local:
                raise CheckpointError(f"{d}: layer {layer} has a static activation scheme but no input_scale")
            s_in = local["input_scale"]
            if s_in.numel() != 1 or not s_in.is_floating_point() or not float(s_in.float().reshape(())) > 0 \
                    or not math.isfinite(float(s_in.float().reshape(()))):
                raise CheckpointError(f"{d}: layer {layer}: input_scale must be one finite positive float, got "
                                      f"{s_in.dtype} {list(s_in.shape)}")
            statics[layer] = s_in.to(torch.float32).reshape(1, 1)
    from lowbit.nn.kv_cache import kv_cache_from_tensors  # optional: transformers
    text_cfg = config.get("text_config") or config
    try:
        kv = kv_cache_from_tensors(config["quantization_config"].get("kv_cache_scheme"), raw,
                                   int(text_cfg.get("num_hidden_layers") or 0),
                                   text_cfg.get("num_key_value_heads", text_cfg.get("num_attention_heads")), str(d))
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    stray = sorted(k for k in raw if k.rpartition(".")[0] in qset and not k.endswith(".bias"))
    if stray:
        raise CheckpointError(f"{d}: unexpected tensors under quantized layers: {stray[:5]}")
    recipe = sidecar.get("recipe") if sidecar is not None else None
    if not isinstance(recipe, (str, type(None))):
        raise CheckpointError(f"{side_path}: recipe must be a name (string), got {str(recipe)[:60]}")
    return CompressedCheckpoint(qtensors, acts, statics, raw, config, recipe, formats, kv)
