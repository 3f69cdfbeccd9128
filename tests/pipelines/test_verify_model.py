"""`lowbit verify-model DIR` / lowbit.pipelines.verify_model.verify_model on checkpoints written the way
`lowbit quantize` writes them (quantize_model + save_compressed) for tiny random dense and MoE models
and an fp8 KV cache: correct checkpoints pass with KL ~ 0 against the exact path; a planted bad kernel
(one layer's weight scale dropped in its forward) is a logic verdict naming the cause, exit status 1."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines import checkpoint as C
from lowbit.pipelines.checkpoint import save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.pipelines.verify_model import verify_model
from moe_fixtures import tiny_moe

transformers = pytest.importorskip("transformers")


def tiny_llama(rng):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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


def test_fp8_kv_checkpoint_passes_and_says_what_it_did_not_check(rng, tmp_path):
    m = tiny_llama(rng)
    quantize_model(m, "w8a16-int8", kv_cache="fp8-head", kv_calib=[torch.randint(0, 96, (2, 16), generator=rng)])
    rep = verify_model(save_compressed(m, tmp_path / "ck", "w8a16-int8"), samples=1, tokens=12)
    assert not rep.logic and rep.kind_verdict("dense") == "ok", rep.report()
    assert any("KV cache" in n for n in rep.not_checked), rep.report()


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
