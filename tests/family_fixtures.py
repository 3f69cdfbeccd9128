"""Tiny random-weight decoders of every family in lowbit.archs.decoders, from the real transformers
classes: 2 layers, hidden 64, float64, every norm gain randomized (so a fold that treats 1 + w as w,
or a post-norm as a pre-norm, changes the logits at the scale of the logits themselves)."""
import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere")

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)


def config(model_type: str):
    import transformers as T
    if model_type == "llama":
        return T.LlamaConfig(**_COMMON)
    if model_type == "mistral":
        return T.MistralConfig(**_COMMON, sliding_window=None)
    if model_type == "qwen2":
        return T.Qwen2Config(**_COMMON)
    if model_type == "qwen3":
        return T.Qwen3Config(**_COMMON, head_dim=16)
    if model_type == "granite":
        return T.GraniteConfig(**_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, logits_scaling=2.0)
    if model_type == "gemma":
        return T.GemmaConfig(**_COMMON, head_dim=16)
    if model_type == "gemma2":
        return T.Gemma2Config(**_COMMON, head_dim=16, attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if model_type == "gemma3_text":
        return T.Gemma3TextConfig(**_COMMON, head_dim=16, final_logit_softcapping=10.0)
    if model_type == "phi3":
        return T.Phi3Config(**_COMMON)
    if model_type == "olmo2":
        return T.Olmo2Config(**_COMMON)
    if model_type == "cohere":
        return T.CohereConfig(**_COMMON, use_qk_norm=True, logit_scale=0.5)
    raise ValueError(model_type)


def _is_norm(m: torch.nn.Module) -> bool:
    n = type(m).__name__
    return n.endswith("RMSNorm") or n.endswith("LayerNorm")


@torch.no_grad()
def tiny_decoder(model_type: str, rng) -> torch.nn.Module:
    """A float64 *ForCausalLM of `model_type` with random weights (seed drawn from `rng`) and every
    norm gain drawn from U(-0.5, 0.5) + 1 (gain w) or U(-0.5, 0.5) (gain 1 + w: Gemma), so each
    family's gains spread over [0.5, 1.5]; one channel per norm is an outlier (gain about 8)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = AutoModelForCausalLM.from_config(config(model_type)).eval().double()
    one_plus = model_type.startswith("gemma")
    for m in model.modules():
        if _is_norm(m):
            w = m.weight
            w.copy_(torch.rand(w.shape, generator=rng, dtype=torch.float64) - 0.5 + (0.0 if one_plus else 1.0))
            w.view(-1)[int(torch.randint(0, w.numel(), (1,), generator=rng))] = 7.0 if one_plus else 8.0
    return model


def ids(rng, batch: int = 2, t: int = 19) -> torch.Tensor:
    return torch.randint(0, 97, (batch, t), generator=rng)
