"""quantize_model on six MoE families: every expert quantized, the router untouched, coverage
reported and enforced, and the quantized model's logits equal to the float model run on the
dequantized weights (the family's own code computing them)."""
import copy

import pytest
import torch

from lowbit.archs.experts import spec_for
from lowbit.nn.experts import QuantExperts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines.coverage import check_coverage, coverage
from lowbit.pipelines.quantize_model import quantize_model
from moe_fixtures import FAMILIES, ids, tiny_moe


def _routers(model):
    return {n: [p.detach().clone() for p in m.parameters()] for n, m in model.named_modules()
            if n.endswith(".gate") or n.endswith(".router") or n.endswith("shared_expert_gate")}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_quantized_router_untouched(family, rng):
    model = tiny_moe(family, rng, dtype=torch.float32)
    routers = _routers(model)
    n_experts = sum(type(m).__name__.endswith("Experts") for m in model.modules())
    summary = quantize_model(model, "w8a8-int8")
    q = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(q) == n_experts == len(summary.experts) >= 1
    assert all(d.action == "quantized" for d in summary.experts)
    cov = summary.coverage
    assert cov.elements("untouched") == 0
    assert cov.elements("quantized") > 0.9 * cov.total          # experts are most of an MoE
    assert cov.by_reason("kept")["router"] == sum(p.numel() for ps in routers.values() for p in ps)
    for n, ps in routers.items():                                  # router weights: same values, not quantized
        mod = model.get_submodule(n)
        assert not isinstance(mod, QuantLinear)
        assert all(torch.equal(a, b) for a, b in zip(mod.parameters(), ps, strict=True))
    shared = [m for n, m in model.named_modules() if "shared_expert" in n and n.endswith("down_proj")]
    assert all(isinstance(m, QuantLinear) for m in shared)       # shared experts are dense Linears
    assert "experts modules quantized" in str(summary) and "coverage:" in str(summary)
    out = model(ids(rng, 9)).logits
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("recipe", ["w8a16-int8", "w4a16-g32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_float_model_on_dequantized_experts(family, recipe, rng):
    """Experts only (every Linear ignored, so they stay float64): the quantized model against
    an independent copy of the float64 model whose fused expert parameters are overwritten with
    the dequantized weights, run by transformers' own code. Only the summation order of the
    expert GEMMs differs (lowbit's exact float64 reference vs F.linear): each differs by at most
    gamma_K(u64) sum|x||w| ~ 64 * 2^-53 of its magnitude, and two random-weight layers amplify a
    relative perturbation by their condition number, which for these models is far below 2^7;
    so |dlogits| <= 2^-39 max|logit| holds with a wide margin, and a single wrong weight
    (one integer step, ~1/254 relative) breaks it by orders of magnitude."""
    model = tiny_moe(family, rng)
    twin = copy.deepcopy(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    summary = quantize_model(model, recipe, ignore=linears)
    assert summary.coverage.elements("untouched") == 0 and not summary.quantized
    with torch.no_grad():
        for d in summary.experts:
            qe = model.get_submodule(d.name)
            tw = twin.get_submodule(d.name)
            for proj, pname in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                deq = qe.weight_dequantized(proj, torch.float64)
                p = getattr(tw, pname)
                p.copy_(deq if spec_for(tw).layout == "enk" else deq.transpose(1, 2))
    x = ids(rng, 17)
    with torch.no_grad():
        got, want = model(x).logits, twin(x).logits
    assert float((got - want).abs().max()) <= 2.0 ** -39 * float(want.abs().max())
    base = tiny_moe(family, torch.Generator().manual_seed(0))     # an unrelated model is far away
    with torch.no_grad():
        far = base(x).logits
    assert float((far - want).abs().max()) > 2.0 ** -39 * float(want.abs().max())


def test_ignore_experts_is_reported_not_silent(rng):
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    s = quantize_model(model, "w8a8-int8", ignore=["model.layers.1.mlp.experts"])
    assert [d.action for d in s.experts] == ["quantized", "skipped"]
    assert isinstance(model.model.layers[1].mlp.experts, torch.nn.Module)
    assert not isinstance(model.model.layers[1].mlp.experts, QuantExperts)
    assert s.coverage.elements("untouched") == 0
    assert "ignore pattern 'model.layers.1.mlp.experts'" in s.coverage.by_reason("kept")
    assert "model.layers.1.mlp.experts: skipped" in str(s)


def test_bad_recipe_for_experts_leaves_model_untouched(rng):
    model = tiny_moe("qwen3_moe", rng, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"experts model\.layers\.0\.mlp\.experts.*group size 128.*ignore="):
        quantize_model(model, "w4a16")                     # H = I = 64: groups of 128 do not fit
    assert not any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())


class _Hidden(torch.nn.Module):
    """A module whose big weight is a bare Parameter used with F.linear (no nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)
        self.table = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return torch.nn.functional.linear(self.proj(x), self.table)


def test_untouched_large_weight_raises_or_warns():
    model = _Hidden()
    with pytest.raises(ValueError, match=r"table \(_Hidden, 4,096\).*ignore"):
        quantize_model(model, "w8a8-int8")
    assert isinstance(model.proj, torch.nn.Linear) and not isinstance(model.proj, QuantLinear)
    with pytest.warns(UserWarning, match="table"):
        s = quantize_model(model, "w8a8-int8", on_untouched="warn")
    assert s.coverage.elements("untouched") == 64 * 64
    assert "UNTOUCHED table" in str(s.coverage)
    cov = coverage(model)
    check_coverage(cov, min_fraction=0.6)                  # below the threshold: accepted
    with pytest.raises(ValueError, match="min_fraction"):
        check_coverage(cov, min_fraction=2)


def test_coverage_of_a_dense_model_before_quantization(rng):
    """Coverage applies to every architecture: a float model has its Linears untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    cov = coverage(model)
    assert cov.elements("quantized") == 0
    assert {r.reason for r in cov.rows if r.status == "kept"} <= {"embedding", "norm", "vector"}
    assert any(r.name.endswith("down_proj.weight") for r in cov.untouched(0.01))
    with pytest.raises(ValueError, match="down_proj"):
        check_coverage(cov)


def test_model_bytes_counts_quantized_experts(rng):
    """bf16 baseline 2 bytes per parameter; each quantized expert weight: int8 codes + one fp32
    scale per row (E rows of N per projection)."""
    from lowbit.nn import model_bytes
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    before = model_bytes(model)
    s = quantize_model(model, "w8a8-int8", ignore=[n for n, m in model.named_modules()
                                                   if isinstance(m, torch.nn.Linear)])
    expect = before
    for d in s.experts:
        E, N2, H = d.shape
        for n, k in ((N2, H), (H, N2 // 2)):
            expect += -2 * E * n * k + E * n * k + 4 * E * n
    assert model_bytes(model) == expect
