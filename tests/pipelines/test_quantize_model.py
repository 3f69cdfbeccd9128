"""quantize_model on a tiny random Llama: what is quantized and what stays, bad input, stored
bytes, static scales, and the prefill-vs-decode check."""
import pytest
import torch

from lowbit.nn import QuantLinear, model_bytes

from lowbit.pipelines.quantize_model import quantize_model
from lowbit.algorithms.static_scales import calibrate_static_scales, clipping_report

U32 = 2.0 ** -24


def tiny_llama(rng, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():   # an outlier channel in the residual stream, as real LLMs have
        model.model.layers[0].input_layernorm.weight[5] = 20.0
    return model


def _ids(rng, n, vocab=97):
    return torch.randint(0, vocab, (1, n), generator=rng)


def test_w8a8_quantizes_every_linear_but_lm_head(rng):
    model = tiny_llama(rng)
    emb = model.model.embed_tokens.weight.clone()
    summary = quantize_model(model, "w8a8-int8")
    qnames = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(qnames) == 2 * 7 and len(summary.quantized) == 14
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    assert [d.name for d in summary.skipped] == ["lm_head"]
    assert "lm_head" in str(summary)
    assert torch.equal(model.model.embed_tokens.weight, emb)            # embeddings untouched
    assert isinstance(model.model.layers[0].input_layernorm, torch.nn.Module)
    out = model(_ids(rng, 21)).logits
    assert torch.isfinite(out).all()


def test_ignore_and_overrides(rng):
    model = tiny_llama(rng)
    s = quantize_model(model, "w8a8-int8", ignore=["model.layers.1.mlp.down_proj"],
                       overrides={"re:.*layers\\.0\\.self_attn\\.[qkv]_proj": "w8a8-fp8", "*.o_proj": "skip"})
    d = {x.name: x for x in s.layers}
    assert d["model.layers.1.mlp.down_proj"].action == "skipped"
    assert d["model.layers.0.self_attn.k_proj"].recipe == "w8a8-fp8"
    assert d["model.layers.1.self_attn.k_proj"].recipe == "w8a8-int8"
    assert d["model.layers.0.self_attn.o_proj"].action == "skipped"
    assert model.model.layers[0].self_attn.k_proj.weight_scheme.format == "fp8_e4m3fn"
    assert s.counts() == {"w8a8-fp8": 3, "w8a8-int8": 8, "skipped": 4}   # 15 Linears in all


def test_bad_input_leaves_model_untouched(rng):
    model = tiny_llama(rng)
    with pytest.raises(ValueError, match="matches no Linear"):
        quantize_model(model, "w8a8-int8", ignore=["model.layers.*.mlp.dense_4h"])
    with pytest.raises(ValueError, match="recipe="):
        quantize_model(model, "int3-magic")
    with pytest.raises(ValueError, match="disagree"):
        quantize_model(model, "w8a8-int8", overrides={"*.down_proj": "skip", "model.layers.0.*": "w8a8-fp8"})
    with pytest.raises(ValueError, match="no torch.nn.Linear"):
        quantize_model(torch.nn.Sequential(torch.nn.Embedding(4, 4), torch.nn.LayerNorm(4)), "w8a8-int8")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj.*NaN/Inf"):
        quantize_model(model, "w8a8-int8")
    # nothing half-done: the earlier layers were not swapped in
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("recipe,bits", [("w8a8-int8", 8), ("w4a16", 4)])
def test_model_bytes(rng, recipe, bits):
    model = tiny_llama(rng)
    before = model_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    assert before == 2 * params                                        # bf16 baseline, 2 bytes each
    s = quantize_model(model, recipe)
    expect = 2 * params
    for d in s.quantized:
        n, k = d.shape
        expect -= 2 * n * k                                              # the bf16 weight is gone
        if recipe == "w8a8-int8":
            expect += n * k + 4 * n                                      # int8 codes + fp32 scale per row
        else:
            groups = -(-k // 128)                                        # short last group counts
            expect += n * groups * 128 * bits // 8 + 4 * n * groups      # nibbles of the padded row + scales
    assert model_bytes(model) == expect


def test_batch_invariance_of_per_token_layers(rng):
    """Per-token scales make each row's output independent of the others: bit-identical whether
    a token runs alone (decode, M = 1) or with 40 others (prefill). One scale per tensor does not."""
    x = torch.randn(41, 64, generator=rng)
    x[:, 3] *= 25.0
    lin = torch.nn.Linear(64, 32)
    from lowbit.nn import get_recipe
    tok = QuantLinear.from_linear(lin, get_recipe("w8a8-int8").weight, get_recipe("w8a8-int8").act)
    ten = QuantLinear.from_linear(lin, get_recipe("w8a8-int8-tensor").weight, get_recipe("w8a8-int8-tensor").act)
    full = tok(x)
    assert all(torch.equal(full[i], tok(x[i:i + 1])[0]) for i in range(x.shape[0]))
    assert not all(torch.equal(ten(x)[i], ten(x[i:i + 1])[0]) for i in range(x.shape[0]))


@torch.no_grad()
def _prefill_vs_decode(model, ids):
    prefill = model(ids).logits[0].double()
    out, past = [], None
    for t in range(ids.shape[1]):
        r = model(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        past = r.past_key_values
        out.append(r.logits[0, -1].double())
    return prefill, torch.stack(out)


def test_prefill_and_decode_logits_agree(rng):
    """Prefill and decode must not mismatch. A float64 model quantized W8A8 per token: the
    decode path (one token at a time with the KV cache, M = 1) must give the prefill logits.
    Derivation: QuantLinear outputs are float32 and row-independent (test above), so for the
    same input row prefill and decode give the same float32 output; the two paths' inputs differ
    only by float64 attention/norm rounding (~1e-16 relative), which at most changes one float32
    re-rounding per QuantLinear (u32 relative). 7 QuantLinears per block in series, L blocks:
    |dlogit| <= 7 L u32 * scale, scale = max|logit| (residual sums keep that magnitude)."""
    model = tiny_llama(rng, torch.float64)
    quantize_model(model, "w8a8-int8")
    ids = _ids(rng, 24)
    pre, dec = _prefill_vs_decode(model, ids)
    L = model.config.num_hidden_layers
    tol = 7 * L * U32 * float(pre.abs().max())
    assert float((pre - dec).abs().max()) <= tol

    # The same check catches the failure mode: one activation scale per tensor makes the
    # decode logits depend on prompt length (scale measured on 1 token vs on 24).
    bad = tiny_llama(rng, torch.float64)
    quantize_model(bad, "w8a8-int8-tensor")
    pre, dec = _prefill_vs_decode(bad, ids)
    assert float((pre - dec).abs().max()) > 100 * tol


def test_static_scales_report_clipping_on_new_text(rng):
    """Static per-tensor fp8 scales calibrated on short low-range prompts clip on wider new input,
    and the report says so; on the calibration text itself nothing clips."""
    model = tiny_llama(rng)
    calib = [_ids(rng, 16) for _ in range(2)]
    from lowbit.nn import get_recipe
    scales = calibrate_static_scales(model, calib, get_recipe("w8a8-fp8").act)
    quantize_model(model, "w8a8-fp8", act_static_scales=scales)
    assert all(m.act_static_scale is not None for m in model.modules() if isinstance(m, QuantLinear))
    same = {r["name"]: r for r in clipping_report(model, calib)}
    # Layer 0's q/k/v see exactly the calibration inputs (no quantized layer upstream): max |x / s|
    # is amax / float32(amax / 448), within two float32 roundings of 448. Later layers see inputs
    # perturbed by upstream quantization and may exceed their calibrated maximum slightly.
    for p in ("q_proj", "k_proj", "v_proj"):
        assert same[f"model.layers.0.self_attn.{p}"]["max_ratio"] <= 1 + 2 * U32
    # "New text": token 7 now points along the outlier channel 5 only. After RMSNorm its channel 5
    # is sqrt(64) * gain = 8 * 20 = 160, the largest value an RMSNorm row can hold there; calibration
    # tokens (random embeddings) reach a fraction of it, so layer 0's static range must clip.
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = 0.0
        model.model.embed_tokens.weight[7, 5] = 1.0
    ids = _ids(rng, 32)
    ids[0, ::3] = 7
    new = {r["name"]: r for r in clipping_report(model, [ids])}
    q0 = new["model.layers.0.self_attn.q_proj"]
    assert q0["clip_rate"] > 0 and q0["max_ratio"] > 1.0
    with pytest.raises(ValueError, match="no scale for layer"):
        quantize_model(tiny_llama(rng), "w8a8-int8", act_static_scales={})


def test_options_object_and_keywords_are_one_path(rng):
    """QuantizeOptions carries the same settings as keywords: the same layers get the same codes;
    keywords replace the object's fields; an unknown name is refused with the nearest option."""
    import copy

    from lowbit.nn import QuantizeOptions
    model = tiny_llama(rng)
    a, b, c = model, copy.deepcopy(model), copy.deepcopy(model)
    ignore = ["model.layers.1.mlp.*"]
    sa = quantize_model(a, "w8a8-int8", ignore=ignore, share_inputs=False)
    sb = quantize_model(b, "w8a8-int8", QuantizeOptions(ignore=ignore, share_inputs=False))
    sc = quantize_model(c, "w8a8-int8", QuantizeOptions(ignore=["nothing"]), ignore=ignore, share_inputs=False)
    assert [d.name for d in sa.quantized] == [d.name for d in sb.quantized] == [d.name for d in sc.quantized]
    assert "model.layers.1.mlp.down_proj" not in {d.name for d in sa.quantized}
    for name, m in a.named_modules():
        if isinstance(m, QuantLinear):
            for other in (b, c):
                assert torch.equal(m.weight_q.codes, other.get_submodule(name).weight_q.codes)
    with pytest.raises(TypeError, match=r"unknown option 'ignor'.*did you mean 'ignore'"):
        quantize_model(copy.deepcopy(model), "w8a8-int8", ignor=ignore)


def test_quantize_model_runs_without_autograd(rng, monkeypatch):
    """quantize_model's own work builds no autograd graph: torch.no_grad sits on the function (not
    on its options class), so what it calls runs with grad mode off."""
    import lowbit.pipelines.quantize_model as qm
    seen, inner = [], qm._quantize_linears
    monkeypatch.setattr(qm, "_quantize_linears", lambda *a, **k: seen.append(torch.is_grad_enabled()) or inner(*a, **k))
    qm.quantize_model(tiny_llama(rng), "w8a8-int8")
    assert seen == [False]
