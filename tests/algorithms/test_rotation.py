"""Hadamard rotation: the matrices are Hadamard (H H^T = n I) for the model sizes that matter,
and the rotated float model computes the same logits (within float32 rounding) with its norm
gains absorbed and lm_head untied."""
import copy

import pytest
import torch

from lowbit.algorithms.rotation import hadamard, random_hadamard, rotate_model


@pytest.mark.parametrize("n", [1, 2, 12, 20, 64, 96, 576, 1536])
def test_hadamard(n):
    h = hadamard(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))   # small integers: exact in float64


def test_hadamard_refuses_impossible_order():
    with pytest.raises(ValueError, match="no Hadamard matrix of order 6"):
        hadamard(6)


def tiny_llama(rng):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:       # non-trivial gains to absorb, with an outlier channel
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=rng)
            layer.input_layernorm.weight[5] = 20.0
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5, generator=rng)
        model.model.norm.weight.uniform_(0.5, 1.5, generator=rng)
    return model


def test_rotation_preserves_logits(rng):
    model = tiny_llama(rng)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ref32 = copy.deepcopy(model)
    model = _norms_in_float64(model.double())
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 97, (2, 17), generator=rng)
    q = rotate_model(model, seed=int(torch.randint(0, 1000, (1,), generator=rng)))
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64), rtol=0, atol=48 * 2.0 ** -52)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.config.tie_word_embeddings
    assert all(torch.equal(l.input_layernorm.weight, torch.ones(48, dtype=torch.float64)) for l in model.model.layers)
    with torch.no_grad():
        a, b, a32 = ref(ids).logits, model(ids).logits, ref32(ids).logits.double()
    # The float64 models run their norms in float64 (_norms_in_float64; LlamaRMSNorm itself
    # computes in float32), so they differ by roundings of relative u64 = 2^-53 per weight and per
    # op; the float32 model differs from the float64 one by roundings of u32 = 2^-24 at the same
    # places, and the network amplifies both alike. So the rotation's error is at most
    # u64 / u32 = 2^-29 times the float32 error, times 8 for the rotation's extra roundings per
    # weight (gain absorption, the product with Q, Q's own rounding).
    assert (a - b).abs().max() <= 8 * 2.0 ** -29 * (a - a32).abs().max()


class _RMSNorm64(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _norms_in_float64(model):
    for l in model.model.layers:
        l.input_layernorm = _RMSNorm64(l.input_layernorm)
        l.post_attention_layernorm = _RMSNorm64(l.post_attention_layernorm)
    model.model.norm = _RMSNorm64(model.model.norm)
    return model
