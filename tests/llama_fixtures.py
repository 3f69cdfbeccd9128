"""A tiny random Llama with outlier channels (shared by the SmoothQuant and AWQ tests)."""
import torch


def outlier_llama(rng, intermediate_size: int):
    """2 layers, hidden 64; the norms in front of q/k/v and gate/up scale one channel by 30 / 25,
    as real LLMs' activations have outlier channels. Weights from a seed drawn from `rng`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=intermediate_size, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[5] = 30.0
            layer.post_attention_layernorm.weight[11] = 25.0
    return model
