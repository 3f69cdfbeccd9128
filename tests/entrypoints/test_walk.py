"""A new user's walk through `lowbit quantize` / `inspect` / `experiment`, item by item: every
incompatibility refused before the model loads (or right after, before any calibration), in one
line with the fix; the bytes printed are the checkpoint's on disk and its float parts have the
dtype config.json says; the user's own text; one-line errors where a traceback used to be.
Tiny random-weight models stand in for the embedded one (see the `tiny` fixture)."""
import json
import os
import re

import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.io.st_format import read_header
from cli_fixtures import no_model, no_texts, one_line_error

transformers = pytest.importorskip("transformers")


def _tiny_config(**kw):
    return transformers.LlamaConfig(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64), **kw})


@pytest.fixture
def tiny(monkeypatch, rng):
    """`lowbit quantize` on a 2-layer random Llama (K = 64 and 96) and random token windows;
    returns (argv prefix, the model, its random ids)."""
    from lowbit.evaluation import workload
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(_tiny_config()).eval()
    ids = torch.randint(0, 64, (256,), generator=rng)
    monkeypatch.setattr(workload, "load_model", lambda spec: workload.Loaded(
        "tiny", model, None, "causal", "a random tiny Llama", torch.bfloat16))
    monkeypatch.setattr(workload, "prepare_texts", lambda loaded, tokens, calib, window, **data: workload.Texts(
        ids[:tokens], [ids[None, :window]], [ids[None, -window:]]))
    return ["quantize", "--tokens", "64", "--calib-tokens", "32", "--window", "32", "--plain"], model, ids


# ------------------------------------------------------------------ refused before loading
def test_w4a16_on_the_embedded_model_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    """K = 576 is no multiple of 128: said at once, with the recipe that fits (any letter case)."""
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--recipe", "W4A16", "--gptq"]) == 2
    one_line_error(capsys, "K = 576", "not a multiple of 128", "use w4a16-g32: 576 and 1536 are multiples of 32",
                    "--no-save")
    assert os.listdir(tmp_path) == []
    # evaluating without a checkpoint needs no K multiple: not refused by this check
    import argparse
    from lowbit.entrypoints import quantize
    p = argparse.ArgumentParser()
    quantize.register(p)
    args = p.parse_args(["--recipe", "w4a16", "--no-save", "--out", str(tmp_path / "o")])
    assert quantize.validate(args)[0] == ["w4a16"]


def test_shapes_from_a_model_directorys_config(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    d = tmp_path / "m"
    d.mkdir()
    _tiny_config().to_json_file(str(d / "config.json"))
    assert main(["quantize", "--model", str(d), "--recipe", "w4a16", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "K = 64", "K = 96", "use w4a16-g32")
    assert main(["quantize", "--model", str(d), "--recipe", "nvfp4,w4a16-asym", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "w4a16-asym", "use w4a16-g32")   # no asymmetric g32 recipe: the symmetric one


@pytest.mark.parametrize("args, words", [
    (["--recipe", "w8a8-int8", "--awq"], ["--awq", "w8a8-int8", "w4a16"]),
    (["--model", "minilm", "--smoothquant"], ["--smoothquant", "encoder"]),
    (["--device", "tpu"], ["--device 'tpu'", "cpu or cuda"]),
    (["--calib-data", "nowhere.txt"], ["--calib-data", "no such file"]),
    (["--eval-data", "data.csv"], ["--eval-data", ".jsonl"]),
    (["--no-eval", "--eval-data", "x.txt"], ["--no-eval"]),
    (["--recipe", "w8a8-int8", "--override-to", "SKIP", "--ignore", "x", "--recipe", "mxfp9"], ["--recipe"]),
])
def test_incompatible_flags_refused_before_loading(monkeypatch, tmp_path, capsys, args, words):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", *args]) == 2
    one_line_error(capsys, *words)
    assert os.listdir(tmp_path) == []


def test_cuda_on_a_machine_without_one(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["quantize", "--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--device cuda", "no CUDA GPU", "--device cpu")


def test_out_clash_found_before_loading(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["quantize", "--recipe", "w8a8-int8", "--out", str(out), "--overwrite"]) == 2
    one_line_error(capsys, "config.json", "move them away")
    assert (out / "config.json").read_text() == "{}"


def test_experiment_sizes_zero(capsys):
    assert main(["experiment", "matmul", "--sizes", "0"]) == 2
    assert "--sizes" in capsys.readouterr().err


def test_truncated_model_directory(tmp_path, capsys, rng):
    """A safetensors file cut short: one line naming it, no traceback."""
    from tokenizers import Tokenizer, models
    d = tmp_path / "m"
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    transformers.LlamaForCausalLM(_tiny_config()).save_pretrained(d)
    transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1},
                                                                                      unk_token="[UNK]"))
                                         ).save_pretrained(d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert main(["quantize", "--model", str(d), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, str(d), "truncated")
    assert not (tmp_path / "o").exists()


def test_help_reads_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"lowbit\.[a-z_]+\.", text), "module paths are jargon in --help"
    assert "GGUF" in text and "Q4_1" in text                 # the embedded baseline's origin
    flat = " ".join(text.split())
    assert "(default 8192, or the whole windows of --eval-data" in flat and "default 1024" in flat


# ------------------------------------------------------------------ after loading, before calibration
def test_plan_checked_after_loading_before_calibration(tiny, monkeypatch, tmp_path, capsys):
    """With --ignore the layers in play are known only from the model: refused before any text."""
    argv, _, _ = tiny
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    assert main([*argv, "--recipe", "w4a16", "--ignore", "*.down_proj", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "K = 64", "use w4a16-g32")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ what is written
def _tensor_dtypes(path):
    entries = read_header(path)[0]
    return {n: e[0] for n, e in entries.items()}


def test_checkpoint_size_dtype_and_mode(tiny, tmp_path, capsys):
    """The bytes printed are the checkpoint's on disk; the float parts are bf16 (the source's
    dtype), config.json says so, the evaluated model is the saved one; the folder is 0755-ish."""
    argv, model, _ = tiny
    out = tmp_path / "q"
    old = os.umask(0o022)
    try:
        assert main([*argv, "--recipe", "W8A8-int8", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    text = capsys.readouterr().out
    on_disk = (out / "model.safetensors").stat().st_size
    m = re.search(r"-> ([0-9.]+) MiB \(on disk\)", text)
    assert m and float(m.group(1)) == round(on_disk / 2**20, 1), text
    dtypes = _tensor_dtypes(out / "model.safetensors")
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert dtypes["model.norm.weight"] == torch.bfloat16 and dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.int8
    assert dtypes["model.layers.0.mlp.down_proj.weight_scale"] == torch.float32
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    from lowbit.pipelines.checkpoint import load_compressed
    ck = load_compressed(out)
    # the model evaluated (rounded in place to bf16) is bit for bit the checkpoint's float part
    assert torch.equal(ck.tensors["model.embed_tokens.weight"].float(), model.model.embed_tokens.weight)
    assert (out.stat().st_mode & 0o777) == 0o755
    md = (out / "lowbit_report.md").read_text()
    assert "Float baseline: a random tiny Llama; float parts rounded to bfloat16" in md
    assert "the checkpoint on disk" in md


def test_dtype_float32_keeps_the_float_parts(tiny, tmp_path, capsys):
    argv, model, _ = tiny
    before = model.model.embed_tokens.weight.detach().clone()
    out = tmp_path / "q"
    assert main([*argv, "--recipe", "w8a16-int8", "--dtype", "float32", "--no-eval", "--out", str(out)]) == 0
    assert torch.equal(model.model.embed_tokens.weight, before)
    assert _tensor_dtypes(out / "model.safetensors")["model.embed_tokens.weight"] == torch.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    text = capsys.readouterr().out
    assert "not evaluated (--no-eval)" in text and "perplexity" not in text.split("\n")[-2]
    assert "not evaluated (--no-eval)" in (out / "lowbit_report.md").read_text()


def test_own_calibration_and_evaluation_files(monkeypatch, tmp_path, rng, capsys):
    """--calib-data / --eval-data token-id files reach calibration and evaluation unchanged."""
    from safetensors.torch import save_file
    from lowbit.evaluation import embedded, workload
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(_tiny_config()).eval()
    monkeypatch.setattr(workload, "load_model", lambda spec: workload.Loaded("tiny", model, None, "causal"))
    spanish = torch.randint(0, 64, (64,), generator=rng)
    monkeypatch.setattr(embedded, "wiki_token_ids", lambda tok, n, split="eval", lang="en-us": spanish[:n])
    ev, cal = torch.randint(0, 64, (100,), generator=rng), torch.randint(0, 64, (1, 80), generator=rng)
    save_file({"ids": ev.to(torch.int32)}, str(tmp_path / "eval.safetensors"))
    save_file({"input_ids": cal}, str(tmp_path / "calib.safetensors"))
    seen = []
    real = workload.prepare_texts
    monkeypatch.setattr(workload, "prepare_texts", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    assert main(["quantize", "--tokens", "64", "--calib-tokens", "64", "--window", "32", "--plain", "--no-save",
                 "--eval-data", str(tmp_path / "eval.safetensors"), "--calib-data", str(tmp_path / "calib.safetensors"),
                 "--out", str(tmp_path / "o")]) == 0
    texts = seen[0]
    assert torch.equal(texts.eval_ids, ev[:64])
    assert torch.equal(torch.cat([c.reshape(-1) for c in texts.calib]), cal.reshape(-1)[:64])
    # a file with fewer tokens than asked for is refused with the count it holds
    assert main(["quantize", "--tokens", "128", "--calib-tokens", "64", "--window", "32", "--plain", "--no-save",
                 "--eval-data", str(tmp_path / "eval.safetensors"), "--out", str(tmp_path / "o2")]) == 2
    one_line_error(capsys, "holds 100 tokens", "--tokens 100")


# ------------------------------------------------------------------ inspect
def test_inspect_groups_layers_and_lists_what_stayed_float(tmp_path, capsys, rng):
    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.pipelines.quantize_model import quantize_model
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(_tiny_config(num_hidden_layers=12, tie_word_embeddings=False)).eval()
    quantize_model(model, "w8a16-int8", ignore=["model.layers.11.mlp.down_proj"])
    out = save_compressed(model, tmp_path / "c", "w8a16-int8")
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.{0..11}.self_attn.q_proj " in text
    assert "model.layers.{0..10}.mlp.down_proj " in text            # layer 11's is not quantized
    rows = [ln for ln in text.splitlines() if ln.startswith("model.")]
    assert len(rows) == 7 and rows[0].startswith("model.layers.{0..10}.mlp.down_proj")   # natural name order
    assert "kept in high precision (quantization_config.ignore): lm_head, model.layers.11.mlp.down_proj" in text
