"""MoE experts in compressed-tensors checkpoints, named as the family's Hugging Face checkpoints
name them: what vLLM's fused-MoE loader and transformers' checkpoint conversion read.

transformers 5 keeps a block's experts fused (gate_up [E, 2I, H], down [E, H, I]); its
checkpoints, and vLLM, keep one Linear per expert and projection. vLLM maps
``<block>.experts.<e>.<gate>.<tensor>`` and ``...<up>.<tensor>`` to ``experts.w13_<tensor>`` and
``...<down>.<tensor>`` to ``experts.w2_<tensor>`` (``FusedMoE.make_expert_params_mapping``), where
<gate>/<up>/<down> are the family's names (Mixtral w1/w3/w2 under ``block_sparse_moe``; Qwen2/3-MoE,
OLMoE, DeepSeek-V3 gate_proj/up_proj/down_proj under ``mlp``) and <tensor> is a compressed-tensors
Linear tensor (``weight_packed``, ``weight_scale``, ...). So each expert's gate and up are the
rows [0, I) and [I, 2I) of its gate_up QTensor, written by the Linear writer
(lowbit.io.ct_layout) unchanged: scales per channel, group or block are row-local, and a
per-tensor (or NVFP4 global) scale is the expert's, written for both.

This module says which names a model's experts have in a checkpoint and splits / joins the
QTensors; lowbit.pipelines.checkpoint writes and reads the files.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from lowbit.archs.experts import BY_FAMILY, ExpertsSpec, find_experts, spec_for
from lowbit.io.st_format import CheckpointError
from lowbit.nn.experts import QuantExperts
from lowbit.quantize import QTensor


@dataclasses.dataclass(frozen=True)
class ExpertsSite:
    """One experts module: its model name, its checkpoint name (``<block>.experts``), its entry
    and its module (QuantExperts, or the family's float module)."""
    name: str
    ckpt: str
    spec: ExpertsSpec
    module: torch.nn.Module

    @property
    def quantized(self) -> bool:
        return isinstance(self.module, QuantExperts)

    def layer(self, e: int, proj: int) -> str:
        """Checkpoint name of expert e's projection proj (0 gate, 1 up, 2 down)."""
        return f"{self.ckpt}.{e}.{self.spec.ckpt_projs[proj]}"


# The names vLLM looks a fused-MoE layer's scheme up by (``<experts>.0.gate_proj`` ...), whatever
# the family's checkpoints call its projections.
VLLM_LOOKUP = ("gate_proj", "up_proj", "down_proj")


def block_pattern(site: ExpertsSite) -> str:
    """A compressed-tensors ``re:`` target naming every expert projection of one block, under the
    family's names and under the names vLLM looks the block's scheme up by (for config groups of
    mixed-scheme checkpoints and the ignore list: one entry per block, not 3 E)."""
    names = "|".join(dict.fromkeys(site.spec.ckpt_projs + VLLM_LOOKUP))
    return rf"re:^{re.escape(site.ckpt)}\.\d+\.({names})$"


def _spec(module: torch.nn.Module) -> ExpertsSpec | None:
    if isinstance(module, QuantExperts):
        return BY_FAMILY.get(module.family)
    return spec_for(module)


def experts_sites(model: torch.nn.Module) -> dict[str, ExpertsSite]:
    """Every experts module of `model` (quantized or float), by model name."""
    out = {}
    for name, m in model.named_modules():
        spec = _spec(m)
        if spec is None and isinstance(m, QuantExperts):
            raise ValueError(f"{name}: QuantExperts of family {m.family!r}, which lowbit.archs.experts does not map; "
                             "its checkpoint names are unknown (build it with QuantExperts.from_module(..., "
                             "family=<a mapped family>))")
        if spec is None:
            continue
        parent, _, leaf = name.rpartition(".")
        block = parent.rpartition(".")
        if spec.ckpt_block:
            parent = f"{block[0]}.{spec.ckpt_block}" if block[0] else spec.ckpt_block
        out[name] = ExpertsSite(name, f"{parent}.{leaf}" if parent else leaf, spec, m)
    return out


def renames(sites: dict[str, ExpertsSite]) -> dict[str, str]:
    """{model prefix: checkpoint prefix} of the blocks a family's checkpoints name otherwise
    (Mixtral: ``model.layers.0.mlp`` -> ``model.layers.0.block_sparse_moe``, router included)."""
    out = {}
    for s in sites.values():
        if s.ckpt != s.name:
            out[s.name.rpartition(".")[0]] = s.ckpt.rpartition(".")[0]
    return out


def rename(name: str, table: dict[str, str]) -> str:
    """`name` with its block prefix replaced by the table's (unchanged when none applies)."""
    for old, new in table.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")   # transformers' names, one per family


def expert_count(config: dict) -> tuple[str, int] | None:
    """(key, value) of the routed-expert count in a config dict, or None."""
    text = config.get("text_config") or config
    for k in COUNT_KEYS:
        v = text.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return k, v
    return None


def check_savable(site: ExpertsSite, config: dict) -> None:
    """Raise, before anything is written, when `site` cannot be stored per expert."""
    qe, spec = site.module, site.spec
    if spec.ckpt_projs is None:
        raise NotImplementedError(
            f"{site.name} ({spec.family}): its checkpoints keep the experts fused (gate_up [E, H, 2I] with gate and "
            "up interleaved, and biases), and neither vLLM's compressed-tensors MoE loader nor transformers' "
            "conversion reads per-expert quantized tensors for it; keep these experts in high precision "
            f"(ignore=[{site.name!r}]) to save the model")
    if qe.glu_split != "chunk":
        raise NotImplementedError(f"{site.name}: gate and up are interleaved; per-expert checkpoints need them "
                                  "as the two halves of gate_up")
    s = qe.weight_scheme
    if s.strategy == "block" and qe.intermediate_dim % s.block_size[0]:
        raise ValueError(f"{site.name}: {s} blocks of {s.block_size[0]} rows straddle gate and up (I = "
                         f"{qe.intermediate_dim}); a per-expert checkpoint needs I to be a multiple of the block rows")
    want = expert_count(config)
    if want is not None and want[1] != qe.num_experts:
        raise ValueError(f"{site.name}: the model holds {qe.num_experts} experts but the config says "
                         f"{want[0]} = {want[1]}; pass the model's own config")


def _rows(qt: QTensor, a: int, b: int) -> QTensor:
    """Rows [a, b) of a 2-D QTensor (scales per tensor are the whole tensor's)."""
    s = qt.scheme
    per = s.block_size[0] if s.strategy == "block" else 1

    def cut(t):
        if t is None or s.strategy == "tensor":
            return t
        return t[a // per: b // per].contiguous()
    return dataclasses.replace(qt, codes=qt.codes[a:b].contiguous(), scale=cut(qt.scale),
                               zero_point=cut(qt.zero_point), scale_codes=cut(qt.scale_codes),
                               shape=(b - a, qt.shape[1]))


def expert_qtensors(site: ExpertsSite):
    """(checkpoint layer name, QTensor) of each expert's gate, up and down, expert by expert."""
    qe, i = site.module, site.module.intermediate_dim
    for e in range(qe.num_experts):
        gu = qe.weight_q("gate_up", e)
        yield site.layer(e, 0), _rows(gu, 0, i)
        yield site.layer(e, 1), _rows(gu, i, 2 * i)
        yield site.layer(e, 2), qe.weight_q("down", e)


def float_expert_weights(site: ExpertsSite):
    """(checkpoint tensor name, [N, K] weight) of each expert of a float experts module."""
    m, spec = site.module, site.spec
    gu, dn = getattr(m, spec.gate_up).detach(), getattr(m, spec.down).detach()
    if spec.layout == "ekn":
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    i = gu.shape[1] // 2
    for e in range(gu.shape[0]):
        for p, w in ((0, gu[e, :i]), (1, gu[e, i:]), (2, dn[e])):
            yield site.layer(e, p) + ".weight", w.contiguous()


def _join_rows(gate: QTensor, up: QTensor, where: str) -> QTensor:
    """The gate_up QTensor of one expert from its gate and up halves."""
    s = gate.scheme
    if up.scheme != s or up.shape[1] != gate.shape[1]:
        raise CheckpointError(f"{where}: gate is {s} {list(gate.shape)} but up is {up.scheme} {list(up.shape)}")
    shared = [f for f in ("global_scale",) + (("scale", "scale_codes", "zero_point") if s.strategy == "tensor"
                                              else ()) if getattr(gate, f) is not None]
    for f in shared:
        if not torch.equal(getattr(gate, f), getattr(up, f)):
            raise CheckpointError(f"{where}: gate and up carry different {f}s ({s}); lowbit's experts keep one "
                                  "per expert, as the quantizer that wrote them would have")

    def cat(f):
        x, y = getattr(gate, f), getattr(up, f)
        return x if x is None or f in shared else torch.cat([x, y])
    return dataclasses.replace(gate, codes=cat("codes"), scale=cat("scale"), zero_point=cat("zero_point"),
                               scale_codes=cat("scale_codes"), shape=(gate.shape[0] + up.shape[0], gate.shape[1]))


_INDEX = re.compile(r"\.(\d+)\.([^.]+)")


def _indices(names, ckpt: str, projs: tuple[str, ...], suffix: str = "") -> dict[str, set[int]]:
    """{projection: expert indices} of the names `<ckpt>.<e>.<proj><suffix>`."""
    out = {p: set() for p in projs}
    for n in names:
        if n.startswith(ckpt + ".") and n.endswith(suffix):
            m = _INDEX.fullmatch(n[len(ckpt): len(n) - len(suffix)])
            if m and m.group(2) in out:
                out[m.group(2)].add(int(m.group(1)))
    return out


def _count_error(where: str, site: ExpertsSite, found: set[int], E: int, key: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {site.ckpt} holds {len(found)} experts (indices {min(found)}..{max(found)}) but config.json says "
        f"{key} = {E}; the checkpoint and its config disagree on the expert count")


def assemble(model: torch.nn.Module, qtensors: dict[str, QTensor], act_schemes: dict, tensors: dict,
             where: str, backend: str = "auto", config: dict | None = None):
    """Rebuild the experts of a model made from config.json out of a checkpoint's per-expert
    layers. Returns (QuantExperts by model name, {model parameter name: fused float tensor} for
    float per-expert weights, checkpoint names consumed, {model prefix: checkpoint prefix}).
    Raises CheckpointError when a block holds another number of experts than the config says,
    misses a projection of some expert, or mixes quantized and float experts."""
    sites = experts_sites(model)
    key = (expert_count(config or {}) or ("the experts dimension",))[0]
    find_experts(model)      # a module with 3-D weights the map does not know is refused by name
    new, dense, used = {}, {}, set()
    for name, site in sites.items():
        spec = site.spec
        if spec.ckpt_projs is None:
            continue            # fused in checkpoints too: loaded as the module's own parameters
        E = int(getattr(site.module, spec.gate_up).shape[0])
        q_idx = _indices(qtensors, site.ckpt, spec.ckpt_projs)
        f_idx = _indices(tensors, site.ckpt, spec.ckpt_projs, ".weight")
        q_all = set().union(*q_idx.values())
        f_all = set().union(*f_idx.values())
        if q_all and f_all:
            raise CheckpointError(f"{where}: {site.ckpt} mixes quantized experts {sorted(q_all)[:4]} and float "
                                  f"experts {sorted(f_all)[:4]}; one block's experts share one scheme")
        idx, found = (q_idx, q_all) if q_all else (f_idx, f_all)
        if not found:
            continue            # the fused parameters, if any, load by their own names
        if found != set(range(E)):
            raise _count_error(where, site, found, E, key)
        missing = [(e, p) for p in spec.ckpt_projs for e in range(E) if e not in idx[p]]
        if missing:
            raise CheckpointError(f"{where}: {site.ckpt} has no {missing[0][1]} for expert {missing[0][0]} "
                                  f"({len(missing)} projections missing); the checkpoint is incomplete")
        if q_all:
            gu, dn, acts = [], [], set()
            for e in range(E):
                g, u, d = (site.layer(e, p) for p in range(3))
                gu.append(_join_rows(qtensors[g], qtensors[u], f"{where}: {g} / {u}"))
                dn.append(qtensors[d])
                acts.update(str(act_schemes[n]) for n in (g, u, d))
                used.update((g, u, d))
            if len(acts) > 1:
                raise CheckpointError(f"{where}: the experts of {site.ckpt} quantize activations differently "
                                      f"({sorted(acts)}); one block's experts share one activation scheme")
            try:
                new[name] = QuantExperts.from_qtensors(
                    site.module, gu, dn, act_schemes[site.layer(0, 0)], gate_up_bias=spec.gate_up_bias,
                    down_bias=spec.down_bias, glu_split=spec.glu_split, activation=spec.activation,
                    family=spec.family, name=site.ckpt, backend=backend)
            except ValueError as err:
                raise CheckpointError(f"{where}: {err}") from err
        else:
            ws = [[tensors[site.layer(e, p) + ".weight"] for e in range(E)] for p in range(3)]
            gu = torch.stack([torch.cat([g, u]) for g, u in zip(ws[0], ws[1])])
            dn = torch.stack(ws[2])
            if spec.layout == "ekn":
                gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
            dense[f"{name}.{spec.gate_up}"], dense[f"{name}.{spec.down}"] = gu, dn
            used.update(site.layer(e, p) + ".weight" for e in range(E) for p in range(3))
    return new, dense, used, renames(sites)


def stray_expert_names(names, sites_ckpt: set[str]) -> list[str]:
    """Checkpoint names that look like per-expert tensors (``.experts.<e>.``) of no experts
    module of the model."""
    pat = re.compile(r"(.*\.experts)\.\d+\.")
    return sorted(n for n in names if (m := pat.match(n)) and m.group(1) not in sites_ckpt)
