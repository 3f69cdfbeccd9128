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


def _model_dir(rng, tmp_path, monkeypatch):
    """(a tiny Mixtral directory with a one-word tokenizer, the user's calibration text, the
    quantize arguments that read them and nothing else)."""
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
    return ["quantize", "--model", str(d), "--plain", "--no-eval", "--tokens", "64", "--calib-tokens", "32",
            "--window", "32", "--calib-data", str(text)]


def test_quantize_writes_a_moe_checkpoint(rng, tmp_path, capsys, monkeypatch):
    args = _model_dir(rng, tmp_path, monkeypatch)
    out = tmp_path / "o"
    assert main(args + ["--recipe", "w4a16-g32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 of 2 experts modules quantized" in text
    assert "warning" not in text              # every loader reads w4a16-g32 experts
    names = set(checkpoint_files(out))
    # vLLM's Mixtral names: block_sparse_moe.experts.<e>.w1 (gate) / w3 (up) / w2 (down)
    assert {f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight_packed" for i in (0, 1) for e in range(4)
            for p in ("w1", "w2", "w3")} <= names
    back = load_compressed(out).to_model()
    assert sum(isinstance(m, QuantExperts) for m in back.modules()) == 2
    with torch.no_grad():
        assert torch.isfinite(back(ids(rng, 5)).logits).all()


def test_quantize_and_inspect_name_the_loader_that_cannot_load(rng, tmp_path, capsys, monkeypatch):
    """W8A8 int8 experts (the default recipe): transformers 5.24 reads experts only from
    weight_packed. One warning line before the checkpoint is written, naming the recipes it
    loads; `lowbit inspect` flags the same loader from config.json alone."""
    args = _model_dir(rng, tmp_path, monkeypatch)
    out = tmp_path / "o"
    assert main(args + ["--recipe", "w8a8-int8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    warned = [line for line in text.splitlines() if line.startswith("warning")]
    assert len(warned) == 1 and "transformers 5.24" in warned[0] and "experts" in warned[0]
    assert "w8a16-int8" in warned[0].split("recipes it loads here:")[1]
    assert text.index(warned[0]) < text.index("experts modules quantized") < text.index("checkpoint:")
    (out / "lowbit.json").unlink()        # inspect reads config.json, not lowbit's record of the run
    assert main(["inspect", str(out)]) == 0 and main(["inspect", str(out), "--strict"]) == 1
    report = capsys.readouterr().out
    assert "[loader-transformers]" in report and "[loader-vllm]" not in report
