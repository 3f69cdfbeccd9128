"""`lowbit quantize --model DIR` on a Mixture-of-experts model directory writes the checkpoint
with every expert quantized, per expert, under the names vLLM's fused-MoE loader reads (from the
user's own calibration text, without evaluation: the embedded corpus is never read)."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.io.st_format import checkpoint_files
from lowbit.nn.experts import QuantExperts
from lowbit.pipelines.checkpoint import load_compressed

from moe_fixtures import ids, tiny_moe

transformers = pytest.importorskip("transformers")


def test_quantize_writes_a_moe_checkpoint(rng, tmp_path, capsys, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers
    import lowbit.evaluation.embedded as embedded

    def no_corpus(package, pip_name):   # --calib-data with --no-eval must not need the embedded text
        raise AssertionError(f"read the embedded corpus ({pip_name})")
    monkeypatch.setattr(embedded, "package_dir", no_corpus)
    d = tmp_path / "m"
    model = tiny_moe("mixtral", rng, dtype=torch.float32, experts=4)
    model.save_pretrained(d)
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()      # one token per word of the calibration text
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    text = tmp_path / "calib.txt"      # the user's own text: no embedded corpus needed
    text.write_text(" ".join(["a"] * 200) + "\n")
    out = tmp_path / "o"
    assert main(["quantize", "--model", str(d), "--recipe", "w4a16-g32", "--plain", "--no-eval", "--tokens", "64",
                 "--calib-tokens", "32", "--window", "32", "--calib-data", str(text), "--out", str(out)]) == 0
    assert "2 of 2 experts modules quantized" in capsys.readouterr().out
    names = set(checkpoint_files(out))
    # vLLM's Mixtral names: block_sparse_moe.experts.<e>.w1 (gate) / w3 (up) / w2 (down)
    assert {f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight_packed" for i in (0, 1) for e in range(4)
            for p in ("w1", "w2", "w3")} <= names
    back = load_compressed(out).to_model()
    assert sum(isinstance(m, QuantExperts) for m in back.modules()) == 2
    with torch.no_grad():
        assert torch.isfinite(back(ids(rng, 5)).logits).all()
