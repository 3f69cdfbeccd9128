"""AWQ: the folds leave each fold site's float function unchanged (within the float32 rounding
bound), the factors follow the formula, the search sees the recipe's own quantizer, and the
scales pay off where activations have outlier channels."""
import copy

import pytest
import torch
from llama_fixtures import outlier_llama

import lowbit as lb
from lowbit.algorithms.awq import awq_factors, awq_model, scaled_loss, search_scale
from lowbit.algorithms.gptq.hessian import output_loss
from lowbit.recipes.presets import get_recipe
from lowbit.quantize import quantize


def tiny_llama(rng):
    return outlier_llama(rng, 80)


def test_factors_formula(rng):
    x = torch.rand(40, generator=rng) * 5
    x[3] = 0.0
    assert torch.equal(awq_factors(x, 0.0), torch.ones(40))     # alpha 0: no scaling
    s = awq_factors(x, 0.5)
    raw = x.double().clamp(min=1e-8).sqrt()
    want = raw / (raw.max() * raw.min()).sqrt()
    want[3] = 1.0
    torch.testing.assert_close(s, want.float(), rtol=2 ** -23, atol=0)   # one float32 rounding
    w = torch.randn(6, 40, generator=rng)
    h = torch.eye(40, dtype=torch.float64)
    scheme = get_recipe("w4a16-g32").weight
    rtn = quantize(w, scheme, pad=True).dequantize(torch.float64)
    assert scaled_loss([w], h, torch.ones(40), scheme) == output_loss(w, rtn, h)


def test_folds_preserve_each_site(rng):
    """gate_proj(post_attention_layernorm(h)) before and after AWQ's fold of the norm group. The
    normalised x_hat is the same on both sides; a term fl(x_hat g_k) W_jk becomes
    fl(x_hat fl(g_k / s_k)) fl(W_jk s_k): 4 roundings of relative u = 2^-24 differ (4u + O(u^2)),
    each float32 dot product of K terms rounds within gamma_K = K u / (1 - K u) of sum |terms|,
    and the bound's own sum |terms| is computed in float32 (one more gamma_K)."""
    model = tiny_llama(rng)
    ref = copy.deepcopy(model)
    batches = [torch.randint(0, 97, (1, 24), generator=rng) for _ in range(2)]
    chosen = awq_model(model, "w4a16-g32", batches)
    assert set(chosen) == {f"model.layers.{i}.{p}" for i in range(2)
                           for p in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj")}
    h = torch.randn(3, 24, 64, generator=rng)
    u = 2.0 ** -24
    for i in range(2):
        a, b = ref.model.layers[i], model.model.layers[i]
        with torch.no_grad():
            y0 = a.mlp.gate_proj(a.post_attention_layernorm(h))
            y1 = b.mlp.gate_proj(b.post_attention_layernorm(h))
            terms = a.post_attention_layernorm(h).abs() @ a.mlp.gate_proj.weight.abs().T
        K = 64
        gamma = K * u / (1 - K * u)
        assert ((y0 - y1).abs() <= (4 * u * (1 + 4 * u) + 3 * gamma) * terms).all()


def test_search_prefers_scaling_on_outliers(rng):
    """Inputs with a few channels 20x larger than the rest: the best factor is not alpha = 0
    (the loss at the chosen alpha is below round-to-nearest's)."""
    K = 96
    x = torch.randn(256, K, generator=rng)
    x[:, :4] *= 20
    w = torch.randn(48, K, generator=rng) * 0.05
    s, alpha, losses = search_scale([w], [x], get_recipe("w4a16-g32").weight)
    assert alpha > 0 and losses[alpha] < losses[0.0]


def test_refuses_activation_recipes(rng):
    with pytest.raises(ValueError, match="weight-only"):
        awq_model(tiny_llama(rng), "w8a8-int8", [torch.randint(0, 97, (1, 8), generator=rng)])


def test_awq_then_quantize(rng):
    """AWQ then RTN: the quantized tiny model is a normal QuantLinear model (w4a16-g32)."""
    model = tiny_llama(rng)
    batches = [torch.randint(0, 97, (1, 24), generator=rng) for _ in range(2)]
    awq_model(model, "w4a16-g32", batches)
    s = lb.nn.quantize_model(model, "w4a16-g32")
    assert len(s.quantized) == 14


@pytest.mark.parametrize("chunk", [1, 3])
def test_candidate_losses_within_the_float32_gate(rng, monkeypatch, chunk):
    """candidate_losses (candidates quantized together, D H in float32) against scaled_loss (one
    candidate, float64) on odd shapes (K not a multiple of the group: padded) and inputs with a
    mean and outlier channels (H far from diagonal): within (gamma_K + 4u) tr(|D| |H| |D|^T) (the
    docstring's gate plus u for the float64 sum's own rounding, far below it), and the pick's
    float64 loss within twice that gate of the float64 minimum."""
    import lowbit.algorithms.awq as awq
    from lowbit.algorithms.gptq.hessian import HessianAccumulator
    N, K = int(torch.randint(9, 40, (1,), generator=rng)), int(torch.randint(40, 100, (1,), generator=rng))
    ws = [torch.randn(N, K, generator=rng) * 0.05 for _ in range(2)]
    x = torch.randn(300, K, generator=rng) + torch.rand(K, generator=rng)
    x[:, :3] *= 15
    acc = HessianAccumulator(K)
    acc.add(x)
    h = acc.hessian()
    scheme = get_recipe("w4a16-g32").weight
    factors = torch.stack([awq_factors(x.abs().mean(0), a) for a in awq.GRID])
    monkeypatch.setattr(awq, "CHUNK_ELEMENTS", chunk * N * K)
    got = awq.candidate_losses(ws, h, factors, scheme)
    u = 2.0 ** -24
    gamma = K * u / (1 - K * u)
    gates = []
    for c, s in enumerate(factors):
        want = scaled_loss(ws, h, s, scheme)
        spread = sum(float(((d.abs() @ h.abs()) * d.abs()).sum())
                     for d in (w.double() - awq.scaled_quantized(w, s[None], scheme)[0] for w in ws))
        gates.append((gamma + 4 * u) * spread)
        assert abs(float(got[c]) - want) <= gates[-1], (c, float(got[c]), want)
    exact = [scaled_loss(ws, h, s, scheme) for s in factors]
    pick = int(got.argmin())
    assert exact[pick] <= min(exact) + 2 * max(gates)
