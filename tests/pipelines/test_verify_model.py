"""`lowbit verify-model DIR` / lowbit.pipelines.verify_model.verify_model on checkpoints written the way
`lowbit quantize` writes them (quantize_model + save_compressed) for tiny random dense and MoE models
and quantized KV caches: correct checkpoints pass with KL ~ 0 against the exact path; planted bad
kernels (one layer's weight scale dropped in its forward; an attention that skips the online-softmax
rescale; a cache that hands attention unquantized states) are logic verdicts naming the cause,
exit status 1."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.nn.kv_cache import LowbitKVLayer
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines import checkpoint as C
from lowbit.pipelines.checkpoint import save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.pipelines.verify_model import verify_model
from moe_fixtures import tiny_moe

transformers = pytest.importorskip("transformers")


def tiny_llama(rng, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _dense_ckpt(rng, tmp_path, recipe="w8a8-int8", **kw):
    m = tiny_llama(rng)
    quantize_model(m, recipe, **kw)
    return save_compressed(m, tmp_path / "ck", recipe)


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8", "w4a16"])
def test_dense_checkpoint_passes(rng, tmp_path, recipe):
    m = tiny_llama(rng)
    kw = {}
    if recipe == "w4a16":       # groups of 128: only the down projections (K = 128) are quantized
        kw["ignore"] = [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and x.in_features % 128]
    quantize_model(m, recipe, **kw)
    rep = verify_model(save_compressed(m, tmp_path / "ck", recipe), samples=2, tokens=12,
                       seed=int(torch.randint(0, 1000, (1,), generator=rng)))
    assert not rep.logic and rep.kind_verdict("dense") == "ok", rep.report()
    assert rep.kl < 1e-6 and rep.top1 == 1.0, rep.report()


def test_moe_checkpoint_passes(rng, tmp_path):
    m = tiny_moe("qwen3_moe", rng, dtype=torch.float32, experts=4, width=64)
    quantize_model(m, "w8a8-int8")
    rep = verify_model(save_compressed(m, tmp_path / "ck", "w8a8-int8"), samples=2, tokens=10)
    assert rep.kind_verdict("experts") == "ok" and rep.kind_verdict("dense") == "ok", rep.report()
    assert rep.kl < 1e-6, rep.report()


@pytest.mark.parametrize("recipe,T", [("w8a8-fp8", 9), ("w4a16", 9), ("w4a16", 40)])
def test_experts_on_their_grouped_kernels_are_checked_per_projection(rng, recipe, T, interpreter, monkeypatch):
    """A MoE layer that ran its grouped kernels (the interpreter here, the GPU in use) is checked one
    projection at a time from the kernel's own inputs, so re-quantizing a GLU output that the exact path
    computes differently is no error; a planted 1 % error in the down projection's output is not ok
    and names the projection."""
    from lowbit.nn.experts import QuantExperts
    from lowbit.pipelines.verify_model import check_experts

    m = tiny_moe("qwen3_moe", rng, dtype=torch.float32, experts=4, width=128)
    quantize_model(m, recipe)
    name, mod = next((n, x) for n, x in m.named_modules() if isinstance(x, QuantExperts))
    mod.backend = "kernel"      # T = 40: 80 sorted rows, where weight-only kinds take the bf16 path
    hidden = torch.randn(T, 128, generator=rng).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=rng)[:2] for _ in range(T)])
    inputs = (hidden, idx, torch.rand(T, 2, generator=rng))
    out = mod(*inputs)
    assert mod.last_path == ("dequant:w4a16" if T == 40 else f"kernel:{mod.kernel}"), mod.last_path
    r = check_experts(name, mod, inputs, out)
    assert r.verdict == "ok", r
    real = QuantExperts.kernel_projections

    def off_by_1pct(self, *a):
        pairs = real(self, *a)
        return pairs[:-1] + [(pairs[-1][0], pairs[-1][1] * 1.01)]
    monkeypatch.setattr(QuantExperts, "kernel_projections", off_by_1pct)
    r = check_experts(name, mod, inputs, out)
    assert r.verdict != "ok" and r.cause.startswith("down"), r


def _kv_ckpt(rng, tmp_path, kv="fp8-head", layers=2):
    m = tiny_llama(rng, layers)
    quantize_model(m, "w8a16-int8", kv_cache=kv, kv_calib=[torch.randint(0, 96, (2, 16), generator=rng)])
    return save_compressed(m, tmp_path / "ck", "w8a16-int8")


@pytest.mark.parametrize("kv,attention", [("fp8-head", None), ("int8-token", None), ("fp8", "fp8")])
def test_kv_checkpoint_attention_is_checked_and_passes(rng, tmp_path, kv, attention):
    # 40 tokens: three 16-key blocks, so the online-softmax rescales are exercised; rows=7: only the
    # last 7 queries of each sequence are checked
    rep = verify_model(_kv_ckpt(rng, tmp_path, kv), samples=2, tokens=40, rows=7, attention=attention,
                       seed=int(torch.randint(0, 1000, (1,), generator=rng)))
    attn = [r for r in rep.layers if r.kind == "attention"]
    assert [r.name for r in attn] == ["model.layers.0.self_attn", "model.layers.1.self_attn"], rep.report()
    assert rep.kind_verdict("attention") == "ok" and not rep.logic and not rep.not_checked, rep.report()
    assert rep.kl < 1e-6 and rep.top1 == 1.0, rep.report()


def _skipped_rescale_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A flash-style attention over 16-key blocks that never rescales O and l when the running max
    grows (the planted bug), written out independently of lowbit's reference."""
    G = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
    Tq, Tk = query.shape[2], k.shape[2]
    s = (query @ k.transpose(-1, -2)) * scaling
    seen = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)
    s = s.masked_fill(~seen, -torch.inf)
    o = torch.zeros_like(query)
    l = torch.zeros(*query.shape[:-1], 1)
    m = torch.full_like(l, -torch.inf)
    for b in range(0, Tk, 16):
        m = torch.maximum(m, s[..., b:b + 16].amax(-1, keepdim=True))
        p = torch.exp(s[..., b:b + 16] - m)         # O and l keep their old scale: no exp(m_old - m_new)
        o, l = o + p @ v[:, :, b:b + 16], l + p.sum(-1, keepdim=True)
    return (o / l).transpose(1, 2).contiguous(), None


def test_planted_bad_attention_kernel_is_named_and_exits_1(rng, tmp_path, monkeypatch, capsys):
    ck = _kv_ckpt(rng, tmp_path)
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "sdpa", _skipped_rescale_sdpa)
    rep = verify_model(ck, samples=2, tokens=48)
    attn = [r for r in rep.layers if r.kind == "attention"]
    assert len(attn) == 2 and all(r.verdict == "logic" for r in attn), rep.report()
    assert all(r.cause.startswith("rescale_skipped") for r in attn), rep.report()
    assert rep.kind_verdict("dense") == "ok", rep.report()
    assert main(["verify-model", str(ck), "--samples", "1", "--tokens", "40"]) == 1
    out = capsys.readouterr().out
    assert "attention" in out and "rescale_skipped" in out


def test_cache_that_hands_attention_unquantized_states_is_named(rng, tmp_path, monkeypatch):
    # transformers' own quantized caches attend a prefill chunk unquantized: the attention then reads
    # values that are not the cache's codes x scales
    def update(self, key_states, value_states, *args, **kwargs):
        real_update(self, key_states, value_states, *args, **kwargs)
        return key_states, value_states

    real_update = LowbitKVLayer.update
    ck = _kv_ckpt(rng, tmp_path, layers=1)
    monkeypatch.setattr(LowbitKVLayer, "update", update)
    rep = verify_model(ck, samples=1, tokens=12)
    attn = [r for r in rep.layers if r.kind == "attention"]
    assert len(attn) == 1 and attn[0].verdict == "logic" and attn[0].cause.startswith("kv_cache_read"), rep.report()


def test_quantized_attention_needs_a_quantized_cache(rng, tmp_path):
    with pytest.raises(ValueError, match="quantizes no KV cache"):
        verify_model(_dense_ckpt(rng, tmp_path), samples=1, tokens=8, attention="fp8")


def test_planted_bad_kernel_is_named_and_exits_1(rng, tmp_path, monkeypatch, capsys):
    ck = _dense_ckpt(rng, tmp_path)
    target = "model.layers.1.mlp.down_proj"
    real = QuantLinear.forward

    def bad(self, x):        # a kernel that forgets the weight scale in one layer
        if getattr(self, "_planted", False):
            codes, scale, _ = self.quantize_input(x.reshape(-1, x.shape[-1]).float())
            acc = codes.double() @ self.weight_q.codes.double().T            # the exact int32 sum
            y = (acc.float() * scale.float()).reshape(*x.shape[:-1], -1)
            return (y + (0 if self.bias is None else self.bias)).to(x.dtype)
        return real(self, x)

    real_to_model = C.CompressedCheckpoint.to_model

    def to_model(self, *a, **k):
        model = real_to_model(self, *a, **k)
        model.get_submodule(target)._planted = True
        return model

    monkeypatch.setattr(QuantLinear, "forward", bad)
    monkeypatch.setattr(C.CompressedCheckpoint, "to_model", to_model)
    rep = verify_model(ck, samples=1, tokens=12)
    bad_layers = [r for r in rep.layers if r.verdict == "logic"]
    assert [r.name for r in bad_layers] == [target], rep.report()
    assert bad_layers[0].cause.startswith("scale_missing"), rep.report()
    assert main(["verify-model", str(ck), "--samples", "1", "--tokens", "8", "--png", str(tmp_path / "v.png")]) == 1
    out = capsys.readouterr().out
    assert "logic" in out and target in out and (tmp_path / "v.png").stat().st_size > 0


def test_cli_refuses_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    assert main(["verify-model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
