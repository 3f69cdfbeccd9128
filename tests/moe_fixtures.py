"""Tiny random-weight MoE models of six transformers 5 families (no download): 2 layers,
hidden 64, 8 experts of intermediate 64 (gpt-oss, DeepSeek-V3: the first layer dense where the
family has one), top-2 routing; float64 with the eager experts implementation (transformers'
default grouped_mm does not take float64), so a test can compare against the family's own code."""
import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
_COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def _config(family: str, experts: int = 8, top_k: int = 2, width: int = 64, layers: int = 2):
    """width: hidden size and expert intermediate size (64; 128 for groups of 128)."""
    import transformers as T
    COMMON = {**_COMMON, "hidden_size": width, "num_hidden_layers": layers}
    if family == "mixtral":
        return T.MixtralConfig(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=width, **COMMON)
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                                shared_expert_intermediate_size=96, intermediate_size=96, **COMMON)
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                                intermediate_size=96, head_dim=16, **COMMON)
    if family == "olmoe":
        return T.OlmoeConfig(num_experts=experts, num_experts_per_tok=top_k, intermediate_size=width,
                             eos_token_id=None, pad_token_id=None, **COMMON)
    if family == "deepseek_v3":
        return T.DeepseekV3Config(n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                                  intermediate_size=96, n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=16, n_shared_experts=1, rope_scaling=None, **COMMON)
    if family == "gpt_oss":
        return T.GptOssConfig(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=width,
                              head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                              rope_scaling=None, **COMMON)
    raise ValueError(family)


def tiny_moe(family: str, rng: torch.Generator, dtype=torch.float64, **kw):
    """A random-weight model of `family` in eval mode (weights drawn from rng's stream)."""
    import transformers as T
    cfg = _config(family, **kw)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(dtype).eval()
    with torch.no_grad():   # routers initialised to zeros in some families: give them a real choice
        for n, p in model.named_parameters():
            if (".gate." in n or ".router." in n) and n.endswith("weight") and p.ndim == 2 and p.shape[0] > 1:
                p.normal_(0.0, 0.5)
    return model


def ids(rng: torch.Generator, n: int, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=rng)


def top_k_index(rng: torch.Generator, T: int, E: int, k: int, kind: str) -> torch.Tensor:
    """Random top-k expert ids [T, k] (distinct per token): "uniform"; "hot" (every token's first
    choice is one expert); "sparse" (only two experts ever chosen, the rest empty; k <= 2);
    "dropped" (about 30% of the slots = E, the expert-parallel marker)."""
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(T)])
    if kind == "hot":
        hot = int(torch.randint(0, E, (1,), generator=rng))
        for t in range(T):
            row = [e for e in idx[t].tolist() if e != hot]
            idx[t] = torch.tensor([hot] + row[:k - 1])
    elif kind == "sparse":
        a, b = torch.randperm(E, generator=rng)[:2].tolist()
        idx = torch.tensor([[a, b] if t % 2 else [b, a] for t in range(T)])[:, :k]
    elif kind == "dropped":
        idx[torch.rand(T, k, generator=rng) < 0.3] = E
        idx[0, 0] = 0
    return idx
