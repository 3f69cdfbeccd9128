"""SmoothQuant: the folds leave the float model's function unchanged (bit-exactly with
power-of-two factors), the factors follow the formula, and smoothing raises the per-site SQNR
of the outlier sites and the quantized model's fidelity."""
import copy
import math

import numpy as np
import pytest
import torch
from llama_fixtures import outlier_llama

from lowbit.pipelines.quantize_model import quantize_model
from lowbit.diagnosis.sites import site_report
from lowbit.algorithms.smoothquant import fold_groups, smooth_model, smoothing_factors


def tiny_llama(rng):
    return outlier_llama(rng, 96)


def _batches(rng, n=3, t=20):
    return [torch.randint(0, 97, (1, t), generator=rng) for _ in range(n)]


def test_fold_points():
    from transformers import LlamaConfig, LlamaForCausalLM
    m = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2))
    g = fold_groups(m)
    assert [x.producer for x in g[:3]] == ["model.layers.0.input_layernorm",
                                          "model.layers.0.post_attention_layernorm", "model.layers.0.mlp.up_proj"]
    assert g[2].consumers == ["model.layers.0.mlp.down_proj"] and len(g) == 6
    with pytest.raises(ValueError, match="no exact fold point"):
        fold_groups(torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)))


def test_factors_follow_formula(rng):
    a = torch.rand(10, generator=rng) * 50 + 0.1
    w1, w2 = torch.randn(6, 10, generator=rng), torch.randn(4, 10, generator=rng)
    alpha = 0.7
    wmax = np.maximum(np.abs(w1.numpy()).max(0), np.abs(w2.numpy()).max(0)).astype(np.float64)
    expect = a.numpy().astype(np.float64) ** alpha / wmax ** (1 - alpha)
    got = smoothing_factors(a, [w1, w2], alpha).numpy()
    # float32 pow/div: a few float32 roundings, relative 1e-6 covers them with margin
    assert np.allclose(got, expect, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="alpha"):
        smoothing_factors(a, [w1], 1.5)


def test_pow2_fold_is_bit_exact(rng):
    """Power-of-two factors: every folded product is exact, so the float logits do not change a bit."""
    model = tiny_llama(rng)
    ids = torch.randint(0, 97, (1, 33), generator=rng)
    with torch.no_grad():
        before = model(ids).logits
    factors = smooth_model(model, _batches(rng), alpha=0.5, pow2=True)
    assert any(bool((s != 1).any()) for s in factors.values())
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)


def test_smoothing_improves_int8_sites_and_logits(rng):
    """Per-token int8 gives an activation SQNR of about 10 log10(12 * 127^2 * mean(x^2) / max(x)^2)
    per token; the 30x outlier channel makes max(x)^2 ~ 64 mean(x^2), i.e. ~34.8 dB (measured
    35.0-35.7). SmoothQuant (alpha 0.5) shrinks the outlier to ~sqrt(30)x, so both the site and
    the logits gain. How much depends on the random model: over 60 seeds (6 x 32 calibration and
    4 x 64 evaluation tokens, as here) the gains were q_proj 4.4 +- 0.6 dB (min 3.1), gate_proj
    5.0 +- 1.1 dB (min 2.6), logits 7.2 +- 1.4 dB (min 4.2). The bounds ask for a real gain, 0.5 dB per site
    (>= 4.3 standard deviations below the means) and 1 dB on the logits (4.6 sd below): the
    earlier 3 dB site bound was within one sd of the mean and failed ~8% of seeds."""
    model = tiny_llama(rng)
    calib, ev = _batches(rng, 6, 32), _batches(rng, 4, 64)
    before = site_report(model, ev, "w8a8-int8").by_name()
    smoothed = copy.deepcopy(model)
    smooth_model(smoothed, calib, alpha=0.5)
    after = site_report(smoothed, ev, "w8a8-int8").by_name()
    for site in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj"):
        assert after[site].act_db > before[site].act_db + 0.5, site      # outlier channel tamed

    def logit_sqnr(float_model, qmodel):
        with torch.no_grad():
            ref = torch.cat([float_model(b).logits for b in ev]).double()
            q = torch.cat([qmodel(b).logits for b in ev]).double()
        return 10 * math.log10(float(ref.pow(2).sum() / (ref - q).pow(2).sum()))

    plain_q = copy.deepcopy(model)
    quantize_model(plain_q, "w8a8-int8")
    smooth_q = copy.deepcopy(smoothed)
    quantize_model(smooth_q, "w8a8-int8")
    assert logit_sqnr(model, smooth_q) > logit_sqnr(model, plain_q) + 1.0
