"""Where the experts of a mixture-of-experts block are: one declarative entry per family.

transformers 5 stores a family's routed experts as one module holding fused 3-D parameters,
not as nn.Linear layers, so a pass that only looks for Linears leaves them (most of an MoE's
parameters) in float. Each entry says, for one experts module class:

- the fused parameter of each projection and its layout: "enk" = [E, N, K] (out, in: what
  F.linear multiplies by, Mixtral and most families) or "ekn" = [E, K, N] (x @ w, gpt-oss);
- the per-expert bias parameters, if any;
- how gate and up share the fused gate_up output ("chunk": first half gate, second half up;
  "interleave": even columns gate, odd columns up) and the activation ("act_fn": the module's
  own act_fn(gate) * up; "gpt_oss": clamped swiglu, (up + 1) * gate * sigmoid(alpha * gate));
- the attribute names of the router / shared experts / shared-expert gate on the parent block
  (for coverage: the router stays in high precision by rule; shared experts are plain
  Linears that QuantLinear handles);
- how the family's Hugging Face checkpoints name the experts, which is what vLLM's MoE loader
  reads (``FusedMoE.make_expert_params_mapping``: ``<block>.experts.<e>.<gate|up|down>.<tensor>``
  go to ``w13_<tensor>`` / ``w2_<tensor>``): the per-expert Linear names (gate, up, down), the
  block's attribute name where the checkpoint's differs from the module's (Mixtral:
  ``block_sparse_moe`` for ``mlp``). A family whose checkpoints keep the experts fused
  (gpt-oss) has no per-expert names.

`find_experts(model)` returns every experts module with its entry; a module that holds 3-D
weight parameters and is not in the map raises, naming its class and what the map lacks:
quantizing the rest and leaving it in float would be a silently half-quantized model.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lowbit.nn.experts import ACTIVATIONS, GLU_SPLITS, LAYOUTS, ExpertsLayout  # noqa: F401  (the vocabularies)


@dataclass(frozen=True)
class ExpertsSpec(ExpertsLayout):
    """How one family stores and runs its routed experts (see the module docstring); the layout
    fields (gate_up, down, layout, biases, glu_split, activation) are lowbit.nn.experts.ExpertsLayout's."""
    family: str
    module_class: str
    router: str = "gate"                     # attribute of the parent block
    shared_experts: str | None = None        # attribute of the parent block (a dense MLP)
    shared_gate: str | None = None           # attribute of the parent block (Linear [1, H])
    ckpt_projs: tuple[str, str, str] | None = ("gate_proj", "up_proj", "down_proj")   # gate, up, down
    ckpt_block: str | None = None            # the parent block's name in checkpoints, when it differs

    @property
    def weights(self) -> tuple[str, str]:
        return (self.gate_up, self.down)

    @property
    def biases(self) -> tuple[str, ...]:
        return tuple(b for b in (self.gate_up_bias, self.down_bias) if b)

    def module_kwargs(self) -> dict:
        """The keyword arguments of lowbit.nn.experts.QuantExperts.from_module for this family."""
        return {**{f.name: getattr(self, f.name) for f in fields(ExpertsLayout)}, "family": self.family}


EXPERTS: dict[str, ExpertsSpec] = {s.module_class: s for s in (
    ExpertsSpec("mixtral", "MixtralExperts", ckpt_projs=("w1", "w3", "w2"), ckpt_block="block_sparse_moe"),
    ExpertsSpec("qwen2_moe", "Qwen2MoeExperts", shared_experts="shared_expert", shared_gate="shared_expert_gate"),
    ExpertsSpec("qwen3_moe", "Qwen3MoeExperts"),
    ExpertsSpec("olmoe", "OlmoeExperts"),
    ExpertsSpec("deepseek_v3", "DeepseekV3Experts", shared_experts="shared_experts"),
    ExpertsSpec("gpt_oss", "GptOssExperts", layout="ekn", gate_up_bias="gate_up_proj_bias",
                down_bias="down_proj_bias", glu_split="interleave", activation="gpt_oss", router="router",
                ckpt_projs=None),
)}
BY_FAMILY: dict[str, ExpertsSpec] = {s.family: s for s in EXPERTS.values()}

# Router modules (not nn.Linear in transformers 5: a bare [E, H] weight Parameter) kept in high
# precision by rule: a changed top-k choice is a discrete error, not a small one.
ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter",
           "DeepseekV3TopkRouter", "GptOssTopKRouter")


def spec_for(module: torch.nn.Module) -> ExpertsSpec | None:
    """The entry for this module's class, or None."""
    return EXPERTS.get(type(module).__name__)


def _fused_params(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters(recurse=False) if p.ndim >= 3]


def check_spec(name: str, module: torch.nn.Module, spec: ExpertsSpec) -> None:
    """Raise when the module does not hold what its entry says (a family changed its storage)."""
    params = dict(module.named_parameters(recurse=False))
    missing = [p for p in spec.weights if p not in params or params[p].ndim != 3]
    missing += [b for b in spec.biases if b not in params or params[b].ndim != 2]
    if missing:
        raise ValueError(f"{name} ({spec.module_class}): lowbit.archs.experts expects 3-D weights {spec.weights} "
                         f"and 2-D biases {spec.biases}; missing or wrong rank: {missing} (has "
                         f"{ {n: tuple(p.shape) for n, p in params.items()} }). Update the {spec.family} entry.")
    extra = [p for p in _fused_params(module) if p not in spec.weights]
    if extra:
        raise ValueError(f"{name} ({spec.module_class}) holds 3-D parameters {extra} that the {spec.family} entry "
                         "does not name; add them to lowbit.archs.experts before quantizing")
    # transformers' experts decorator records the same facts: a disagreement means the entry is stale
    flags = {"is_transposed": spec.layout == "ekn", "is_concatenated": spec.glu_split == "chunk",
             "has_bias": bool(spec.biases), "has_gate": True, "has_post_expert_norm": False}
    wrong = {k: getattr(module, k) for k, v in flags.items() if hasattr(module, k) and getattr(module, k) != v}
    if wrong:
        raise ValueError(f"{name} ({spec.module_class}) says {wrong}, the {spec.family} entry of "
                         f"lowbit.archs.experts assumes {({k: flags[k] for k in wrong})}; update the entry")
    gu, dn = params[spec.gate_up], params[spec.down]
    E = gu.shape[0]
    n2, k = (gu.shape[1], gu.shape[2]) if spec.layout == "enk" else (gu.shape[2], gu.shape[1])
    dn_n, dn_k = (dn.shape[1], dn.shape[2]) if spec.layout == "enk" else (dn.shape[2], dn.shape[1])
    if dn.shape[0] != E or n2 % 2 or dn_k != n2 // 2 or dn_n != k:
        raise ValueError(f"{name} ({spec.module_class}): {spec.gate_up} {tuple(gu.shape)} and {spec.down} "
                         f"{tuple(dn.shape)} do not fit layout {spec.layout!r} (gate_up [E, 2I, H], down [E, H, I] "
                         "as [E, N, K]); fix the entry's layout")


def find_experts(model: torch.nn.Module) -> dict[str, ExpertsSpec]:
    """name -> ExpertsSpec of every routed-experts module in `model` (already quantized ones,
    lowbit.nn.experts.QuantExperts, are not listed). Raises ValueError for a module with 3-D
    weight parameters that the map does not know, naming its class."""
    out: dict[str, ExpertsSpec] = {}
    for name, mod in model.named_modules():
        spec = spec_for(mod)
        if spec is not None:
            check_spec(name, mod, spec)
            out[name] = spec
        elif _fused_params(mod) and type(mod).__name__ != "QuantExperts":
            shapes = {n: tuple(p.shape) for n, p in mod.named_parameters(recurse=False) if p.ndim >= 3}
            raise ValueError(f"module {name} ({type(mod).__name__}) holds 3-D weight parameters {shapes} that look "
                             "like fused MoE experts, but lowbit.archs.experts has no entry for "
                             f"{type(mod).__name__}: add an ExpertsSpec (parameter names, layout [E, N, K] or "
                             "[E, K, N], biases, gate/up split, activation, router) or ignore the module explicitly")
    return out


def router_of(model: torch.nn.Module, experts_name: str, spec: ExpertsSpec) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of the router beside an experts module, or None when the block has none."""
    parent = experts_name.rpartition(".")[0]
    name = f"{parent}.{spec.router}" if parent else spec.router
    try:
        return name, model.get_submodule(name)
    except AttributeError:
        return None


def checkpoint_sources(spec: ExpertsSpec, ckpt_experts: str, param: str,
                       shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
    """The per-expert checkpoint tensors a fused experts parameter is made of, in order: their
    concatenation, each flattened, is the parameter flattened. ckpt_experts: the experts
    module's name in checkpoints (``<block>.experts``, the block under spec.ckpt_block where the
    family renames it); param: spec.gate_up or spec.down; shape: the parameter's.

    This is transformers' own checkpoint conversion for these families read backwards
    (conversion_mapping: MergeModulelist(dim=0) of the experts, then Concatenate(dim=1) of gate
    and up): gate_up [E, 2I, H] is, expert by expert, the rows of gate [I, H] then those of
    up [I, H]; down [E, H, I] is each expert's down [H, I]. Returns None for a family whose
    checkpoints keep the experts fused (spec.ckpt_projs None: the parameter is read by its own
    name). Raises ValueError for what the mapping cannot express: biases stored per expert,
    the [E, K, N] layout, a parameter that is not one of the two weights, or a shape that does
    not split so."""
    if spec.ckpt_projs is None:
        return None
    if spec.biases or spec.layout != "enk":
        raise ValueError(f"{ckpt_experts} ({spec.family}): per-expert checkpoint names with biases {spec.biases} or "
                         f"layout {spec.layout!r} are not mapped; only [E, N, K] weights without biases are")
    gate, up, down = spec.ckpt_projs
    if len(shape) != 3:
        raise ValueError(f"{ckpt_experts}.{param} ({spec.family}): expected a 3-D fused weight, got shape {shape}")
    E, N, K = shape
    if param == spec.gate_up:
        if N % 2:
            raise ValueError(f"{ckpt_experts}.{param} ({spec.family}): gate_up {shape} has an odd row count")
        return [(f"{ckpt_experts}.{e}.{p}.weight", (N // 2, K)) for e in range(E) for p in (gate, up)]
    if param == spec.down:
        return [(f"{ckpt_experts}.{e}.{down}.weight", (N, K)) for e in range(E)]
    raise ValueError(f"{ckpt_experts}.{param} ({spec.family}): not one of the entry's weights {spec.weights}")
