"""Tiny random-weight decoders of every family in lowbit.archs.decoders, from the real transformers
classes: 2 layers, hidden 64, float64, every norm gain randomized (so a fold that treats 1 + w as w,
or a post-norm as a pre-norm, changes the logits at the scale of the logits themselves)."""
import torch

U32 = 2.0 ** -24
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere")

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)


def config(model_type: str, **kw):
    """kw: config values that replace the tiny defaults (e.g. hidden_size, num_hidden_layers)."""
    import transformers as T
    c = {**_COMMON, **kw}
    if model_type == "llama":
        return T.LlamaConfig(**c)
    if model_type == "mistral":
        return T.MistralConfig(**c, sliding_window=None)
    if model_type == "qwen2":
        return T.Qwen2Config(**c)
    if model_type == "qwen3":
        return T.Qwen3Config(**c, head_dim=16)
    if model_type == "granite":
        return T.GraniteConfig(**c, embedding_multiplier=3.0, residual_multiplier=0.5,
                               attention_multiplier=0.2, logits_scaling=2.0)
    if model_type == "gemma":
        return T.GemmaConfig(**c, head_dim=16)
    if model_type == "gemma2":
        return T.Gemma2Config(**c, head_dim=16, attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if model_type == "gemma3_text":
        return T.Gemma3TextConfig(**c, head_dim=16, final_logit_softcapping=10.0)
    if model_type == "phi3":
        return T.Phi3Config(**c)
    if model_type == "olmo2":
        return T.Olmo2Config(**c)
    if model_type == "cohere":
        return T.CohereConfig(**c, use_qk_norm=True, logit_scale=0.5)
    raise ValueError(model_type)


def _is_norm(m: torch.nn.Module) -> bool:
    n = type(m).__name__
    return n.endswith("RMSNorm") or n.endswith("LayerNorm")


@torch.no_grad()
def tiny_decoder(model_type: str, rng, **kw) -> torch.nn.Module:
    """A float64 *ForCausalLM of `model_type` with random weights (seed drawn from `rng`) and every
    norm gain drawn from U(-0.5, 0.5) + 1 (gain w) or U(-0.5, 0.5) (gain 1 + w: Gemma), so each
    family's gains spread over [0.5, 1.5]; one channel per norm is an outlier (gain about 8)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = AutoModelForCausalLM.from_config(config(model_type, **kw)).eval().double()
    one_plus = model_type.startswith("gemma")
    for m in model.modules():
        if _is_norm(m):
            w = m.weight
            w.copy_(torch.rand(w.shape, generator=rng, dtype=torch.float64) - 0.5 + (0.0 if one_plus else 1.0))
            w.view(-1)[int(torch.randint(0, w.numel(), (1,), generator=rng))] = 7.0 if one_plus else 8.0
    return model


def ids(rng, batch: int = 2, t: int = 19) -> torch.Tensor:
    return torch.randint(0, 97, (batch, t), generator=rng)


def logits_gate(cfg, ref: torch.Tensor, weight_rel: float = 0.0) -> float:
    """How far two float32 forwards of one decoder (config `cfg`) may put the logits apart when
    they differ only in summation order and, optionally, in weights within `weight_rel` of each
    other elementwise (one side's weights rounded, e.g. to bf16).

    Each length-K dot product is within K*u32*sum|x w| of exact (Higham's gamma_K), and a weight
    perturbation of relative size r moves it by at most r*sum|x w|; through at most 7 matmuls a
    decoder layer plus lm_head, the logits agree within 2 * depth * (K*u32 + r) * max|logits|
    (K the longest contraction)."""
    depth = 7 * cfg.num_hidden_layers + 1
    k = max(cfg.hidden_size, getattr(cfg, "moe_intermediate_size", 0) or 0, cfg.intermediate_size or 0)
    return 2 * depth * (k * U32 + weight_rel) * ref.abs().max().item()
