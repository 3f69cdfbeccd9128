"""The mixture-of-experts side of `lowbit bench model --shape mixtral | qwen3-30b-a3b`: the
model shapes, the two bf16 baselines and the expert part of the weight memory.

Models: transformers' own MixtralForCausalLM / Qwen3MoeForCausalLM built from their configs with
random weights (transformers' initialisation, normal std 0.02), on the device, in the bench's
dtype; nothing is downloaded. The shapes are those of the released models, with fewer layers.

Baselines, both in the bench's dtype and in the same process as the recipes:
- "bf16" (kind baseline): transformers' expert loop, `experts_implementation="eager"`: one
  F.linear pair per expert that received tokens. Recent transformers default to their
  grouped_mm implementation, so the loop is asked for by name and checked.
- "bf16-grouped" (kind grouped): the same fused bf16 parameters run by `GroupedMMExperts`, two
  `torch._grouped_mm` calls per MoE block over the tokens sorted by expert (the PyTorch
  schema: _grouped_mm(Tensor self, Tensor mat2, Tensor? offs=None, Tensor? bias=None,
  ScalarType? out_dtype=None); self [M, K], mat2 [E, K, N] with 16-byte aligned strides, offs
  int32 [E] the cumulative row ends, no bias, output in self's dtype). It has no host
  synchronisation, so torch.compile captures it whole and CUDA graphs replay it. A torch
  without torch._grouped_mm makes its rows "n/a", never a silent loop.

Expert memory: the bytes of every tensor the experts modules hold on the device (parameters,
buffers, prepared copies), each storage once, counted with lowbit.bench.model_measure's
resident_bytes, so a recipe that keeps codes beside a packed copy is charged for both. The
reusable bf16 buffers of the grouped bf16 path (lowbit.ops.grouped_dequant: one per projection
shape) are not the experts' own: each row reports what is held after its call (scratch_bytes) and
its peak counts them; each lowbit row names the grouped path its experts take at its number of
sorted rows (expert_paths: the tuning table's, else the heuristic's).
"""
from __future__ import annotations

from collections import Counter

import torch

from lowbit.archs.experts import find_experts
from lowbit.bench.model_measure import Skipped, resident_bytes
from lowbit.nn.experts import QuantExperts

GROUPED = "bf16-grouped"

# Released configs (hidden, expert intermediate, experts, top-k, heads, KV heads, head_dim,
# vocabulary, rope theta); the tiny ones are the CPU tests' (K multiples of 128: w4a16's group).
SHAPES: dict[str, dict] = {
    "mixtral": dict(family="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                    rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False),            # Mixtral-8x7B
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True,
                          tie_word_embeddings=False),                                         # Qwen3-30B-A3B
    "tiny-mixtral": dict(family="mixtral", hidden_size=128, intermediate_size=128, num_local_experts=5,
                         num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny-qwen3-moe": dict(family="qwen3_moe", hidden_size=128, moe_intermediate_size=128, intermediate_size=256,
                           num_experts=12, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, vocab_size=256, rope_theta=1e4, rms_norm_eps=1e-6, norm_topk_prob=True,
                           tie_word_embeddings=False),
}


def is_moe(shape: str) -> bool:
    return shape in SHAPES


def build_moe(shape: str, layers: int, dtype: torch.dtype, device: str, seed: int,
              max_positions: int = 8192) -> torch.nn.Module:
    """The CausalLM of SHAPES[shape] with `layers` decoder layers (every one a MoE layer), eval
    mode, on `device` in `dtype`, running transformers' expert loop; weights drawn after
    torch.manual_seed(seed) on `device` in float32 (same (seed, device), same model)."""
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r} is not a MoE shape; choose one of {', '.join(SHAPES)}")
    if layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one decoder layer")
    kw = dict(SHAPES[shape])
    family = kw.pop("family")
    if family == "mixtral":
        from transformers import MixtralConfig as Config, MixtralForCausalLM as Model
    else:
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model
    cfg = Config(**kw, num_hidden_layers=layers, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Model(cfg)
    model = model.to(dtype=dtype).eval()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:   # a transformers version that leaves fused experts uninitialised would time garbage
        raise RuntimeError(f"{shape}: transformers' initialisation left NaN/Inf in {bad[:4]}")
    use_loop(model)
    return model


def experts_implementation(model: torch.nn.Module) -> str | None:
    """transformers' experts implementation of the model (None where it has no such setting:
    the experts' own forward, the loop, is all there is)."""
    return getattr(model.config, "_experts_implementation", None)


def use_loop(model: torch.nn.Module) -> None:
    """Make the model run transformers' expert loop ("eager"), and check that it does."""
    if experts_implementation(model) in (None, "eager"):
        return
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    else:
        model.config._experts_implementation = "eager"
    if experts_implementation(model) != "eager":
        raise RuntimeError(f"could not select transformers' expert loop: experts_implementation is still "
                           f"{experts_implementation(model)!r}")


def expert_names(model: torch.nn.Module) -> list[str]:
    """Names of the routed-experts modules (lowbit.archs.experts finds them); the same names
    hold the quantized or grouped replacements in every variant."""
    return list(find_experts(model))


def expert_bytes(model: torch.nn.Module, names: list[str], device: torch.device) -> int:
    """Bytes of every tensor the experts modules `names` hold on `device`, each storage once."""
    return resident_bytes(torch.nn.ModuleList([model.get_submodule(n) for n in names]), device)


# ------------------------------------------------------------------------------ grouped bf16
def grouped_mm_op():
    """torch._grouped_mm, or None where this torch has none."""
    return getattr(torch, "_grouped_mm", None)


class GroupedMMExperts(torch.nn.Module):
    """A transformers experts module ([E, 2I, H] gate_up, [E, H, I] down, gate and up in
    halves, act_fn(gate) * up) run by two torch._grouped_mm calls: tokens sorted by expert,
    one call for all experts per projection, routing weights applied and the top-k outputs of
    each token summed in float32 (as transformers' grouped_mm implementation does), then cast
    to the input's dtype. Holds the replaced module's own Parameters (no copy)."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if gu is None or dn is None or gu.ndim != 3 or dn.ndim != 3 or getattr(experts, "is_transposed", False):
            raise ValueError(f"GroupedMMExperts needs fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj "
                             f"parameters; {type(experts).__name__} has other storage")
        if getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True):
            raise ValueError(f"GroupedMMExperts runs bias-free experts with gate and up in halves; "
                             f"{type(experts).__name__} is not one")
        self.gate_up_proj, self.down_proj = gu, dn
        self.act_fn = experts.act_fn
        self.num_experts = int(gu.shape[0])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        T, k = top_k_index.shape
        E = self.num_experts
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)                  # (token, slot) pairs, expert 0's first
        counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))   # no host sync (bincount would size itself)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        mm = torch._grouped_mm
        h = mm(hidden_states[order // k], self.gate_up_proj.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        y = y.float() * top_k_weights.reshape(-1)[order].float()[:, None]
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return y[inv].view(T, k, -1).sum(1).to(hidden_states.dtype)


def build_grouped(master: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the loop baseline whose experts modules run GroupedMMExperts; Skipped
    (the rows say n/a) where this torch has no torch._grouped_mm."""
    import copy

    if grouped_mm_op() is None:
        raise Skipped(f"n/a: torch {torch.__version__} has no torch._grouped_mm (the grouped bf16 baseline)")
    model = copy.deepcopy(master)
    for name in expert_names(model):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, GroupedMMExperts(model.get_submodule(name)))
    return model


# ------------------------------------------------------------------------------ lowbit variants
def untimed_experts(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of QuantExperts that would run their exact float64 path on `device` (CUDA only:
    a recipe with no grouped kernel; on the CPU the exact path is the one there is). Such a
    variant is not timed: the exact path is a reference, and at these shapes it takes minutes."""
    if device.type != "cuda":
        return []
    return [n for n, m in model.named_modules()
            if isinstance(m, QuantExperts) and m.backend != "exact" and hasattr(m, "kernel") and m.kernel is None]


def expert_paths(model: torch.nn.Module, tokens: int, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """How many QuantExperts take each path (QuantExperts.path_for: "exact", "kernel:<kind>",
    "dequant:<kind>", ...) for `tokens` hidden states of `dtype` on `device`: tokens x
    num_experts_per_tok sorted rows."""
    k = int(model.config.num_experts_per_tok)
    return dict(Counter(m.path_for(tokens * k, dtype, device) for m in model.modules() if isinstance(m, QuantExperts)))


def describe_experts(model: torch.nn.Module) -> dict:
    """weight / act schemes and the grouped kernel of the first QuantExperts (the bench's rows
    say which arithmetic was timed)."""
    m = next((m for m in model.modules() if isinstance(m, QuantExperts)), None)
    if m is None:
        return {}
    return dict(expert_weight=str(m.weight_scheme), expert_act=None if m.act_scheme is None else str(m.act_scheme),
                expert_kernel=getattr(m, "kernel", None))
