"""`lowbit quantize` on models and data as users keep them: a model id from the local Hugging Face
cache (never the network), a folder missing its tokenizer or weights named before loading, .parquet
/ saved-dataset / chat data checked before loading, default token counts that fit the data given,
the best-measures line about this model, --save-float, and SIGTERM ending like Ctrl-C."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from lowbit.entrypoints.main import main
from cli_fixtures import SLOW_WRITES, no_model, one_line_error, save_tokenizer

transformers = pytest.importorskip("transformers")


def _config(**kw):
    return transformers.LlamaConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64), **kw})


def _model(rng):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(_config()).eval()


def _fake_cache(root, model_id, model, rev="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    model.save_pretrained(snap)
    save_tokenizer(snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


# ------------------------------------------------------------------ the Hugging Face cache
@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_model_id_loads_from_the_local_cache(tmp_path, monkeypatch, rng, env):
    from lowbit.evaluation.workload import load_model
    model = _model(rng)
    cache = tmp_path / "hub"
    snap = _fake_cache(cache, "acme/tiny-llama", model)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(cache if env == "HF_HUB_CACHE" else tmp_path))   # HF_HOME: its hub/ folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")            # the network is never asked
    loaded = load_model("acme/tiny-llama")
    assert loaded.name == "tiny-llama" and str(snap) in loaded.origin
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.model.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    with pytest.raises(FileNotFoundError, match=f"acme/other: not in the local Hugging Face cache \\({cache}"):
        load_model("acme/other")


def test_a_model_id_not_in_the_cache_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--model", "acme/absent"]) == 2
    one_line_error(capsys, "--model acme/absent: not in the local Hugging Face cache", "hf download acme/absent")


# ------------------------------------------------------------------ the model folder's files
def _folder(tmp_path, rng, weights=True, tokenizer=True):
    d = tmp_path / "m"
    _model(rng).save_pretrained(d)
    if not weights:
        (d / "model.safetensors").unlink()
    if tokenizer:
        save_tokenizer(d)
    return d


@pytest.mark.parametrize("what, words", [
    ("tokenizer", ["no tokenizer files", "tokenizer.json"]),
    ("weights", ["no weight files", "model.safetensors"]),
    ("shard", ["model.safetensors.index.json lists 2 weight files", "model-00002-of-00002.safetensors is missing"]),
])
def test_missing_model_files_are_named_before_loading(tmp_path, monkeypatch, capsys, rng, what, words):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    d = _folder(tmp_path, rng, weights=what != "weights", tokenizer=what != "tokenizer")
    if what == "shard":
        index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    assert main(["quantize", "--model", str(d), "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, f"--model {d}", *words)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ data checked before loading
datasets = pytest.importorskip("datasets")


def _data(tmp_path, rng):
    """Bad data files of every kind: {name: path}."""
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "plain.txt").write_text("some text")
    datasets.Dataset.from_dict({"body": ["a", "b"], "id": [1, 2]}).to_parquet(str(tmp_path / "cols.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    from safetensors.torch import save_file
    save_file({"ids": torch.randint(0, 64, (100,), generator=rng)}, str(tmp_path / "ids.safetensors"))
    return tmp_path


@pytest.mark.parametrize("args, words", [
    (["--calib-data", "{d}/cols.parquet"], ["--calib-data", "no column 'text' (or 'messages')", "columns are body, id",
                                            "--text-column"]),
    (["--eval-data", "{d}/cols.parquet", "--text-column", "title"], ["--eval-data", "no column 'title'"]),
    (["--calib-data", "{d}/dd"], ["DatasetDict of splits (train)", "dd/train"]),
    (["--calib-data", "{d}/plain.txt", "--chat-template", "on"], ["--chat-template on", "holds no chat conversations"]),
    (["--model", "minilm", "--calib-data", "{d}/chat.jsonl", "--chat-template", "on"],
     ["--chat-template on", "no chat template", "--chat-template off"]),
    (["--text-column", "body"], ["--text-column", "give one of them"]),
    (["--eval-data", "{d}/ids.safetensors", "--tokens", "512"], ["holds 100 tokens, fewer than --tokens 512"]),
    (["--eval-data", "{d}/ids.safetensors", "--window", "128"], ["holds 100 tokens, less than one --window of 128"]),
    (["--calib-data", "{d}/ids.safetensors", "--text-column", "text"], ["token ids", "drop --text-column"]),
    (["--model", "minilm", "--eval-data", "{d}/ids.safetensors", "--window", "32"], ["encoder", "sentences"]),
])
def test_bad_data_is_refused_before_loading(tmp_path, monkeypatch, capsys, rng, args, words):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    d = _data(tmp_path / "data", rng) if (tmp_path / "data").mkdir() is None else None
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", *[a.format(d=d) for a in args]]) == 2
    one_line_error(capsys, *words)
    assert sorted(os.listdir(tmp_path)) == ["data"]                 # nothing written


# ------------------------------------------------------------------ runs on a tiny model
@pytest.fixture
def tiny_real_texts(monkeypatch, rng):
    """A 1-layer random Llama whose texts go through the real prepare_texts (the Spanish unseen
    text replaced by random ids: the model has no tokenizer)."""
    from lowbit.evaluation import embedded, workload
    model = _model(rng)
    monkeypatch.setattr(workload, "load_model", lambda spec: workload.Loaded("tiny", model, None, "causal"))
    spanish = torch.randint(0, 128, (64,), generator=rng)
    monkeypatch.setattr(embedded, "wiki_token_ids", lambda tok, n, split="eval", lang="en-us": spanish[:n])
    seen = []
    real = workload.prepare_texts
    monkeypatch.setattr(workload, "prepare_texts", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    return model, seen


def test_default_token_counts_fit_the_data_given(tmp_path, rng, capsys, tiny_real_texts):
    from safetensors.torch import save_file
    _, seen = tiny_real_texts
    n_eval, n_cal = (int(v) for v in torch.randint(40, 200, (2,), generator=rng))
    ev, cal = torch.randint(0, 128, (n_eval,), generator=rng), torch.randint(0, 128, (n_cal,), generator=rng)
    save_file({"ids": ev}, str(tmp_path / "eval.safetensors"))
    save_file({"ids": cal}, str(tmp_path / "calib.safetensors"))
    assert main(["quantize", "--window", "32", "--plain", "--no-save", "--eval-data", str(tmp_path / "eval.safetensors"),
                 "--calib-data", str(tmp_path / "calib.safetensors"), "--out", str(tmp_path / "o")]) == 0
    use_ev, use_cal = n_eval // 32 * 32, n_cal // 32 * 32            # whole windows of 32
    texts = seen[0]
    assert torch.equal(texts.eval_ids, ev[:use_ev])
    assert torch.equal(torch.cat([c.reshape(-1) for c in texts.calib]), cal[:use_cal])
    out = capsys.readouterr().out
    assert f"holds {n_eval} tokens, fewer than the default --tokens 8192: using {use_ev}" in out
    assert f"holds {n_cal} tokens, fewer than the default --calib-tokens 1024: using {use_cal}" in out
    assert f"on {use_ev} tokens" in out                                # the evaluation line says what was read


def test_the_best_measures_line_counts_this_models_sites(tmp_path, capsys, tiny_real_texts):
    """The default w8a8-int8 measures keep the worst 5% of Linears in high precision: on a model
    of a handful of Linears that is 0 sites, and the line says so (and no SmolLM2 figure)."""
    from safetensors.torch import save_file
    model, _ = tiny_real_texts
    save_file({"ids": torch.randint(0, 128, (64,))}, str(tmp_path / "ids.safetensors"))
    n = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert 0.05 * n < 1
    assert main(["quantize", "--window", "32", "--no-save", "--calib-data", str(tmp_path / "ids.safetensors"),
                 "--eval-data", str(tmp_path / "ids.safetensors"), "--out", str(tmp_path / "o")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "measured best" in ln)
    assert f"no site kept in high precision (5% of this model's {n} Linears is 0 sites)" in line, line
    assert "SmoothQuant (alpha 0.5)" in line and "+0.75%" not in line and "worst sites" not in line


def test_save_float_writes_the_baseline_transformers_loads(tmp_path, rng, capsys, tiny_real_texts):
    from safetensors.torch import save_file
    model, _ = tiny_real_texts
    save_file({"ids": torch.randint(0, 128, (64,), generator=rng)}, str(tmp_path / "ids.safetensors"))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert main(["quantize", "--window", "32", "--plain", "--no-eval", "--calib-data", str(tmp_path / "ids.safetensors"),
                 "--out", str(tmp_path / "q"), "--save-float", str(tmp_path / "float")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.float32).eval()
    got = back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ids = torch.randint(0, 128, (1, 17), generator=rng)
    ref = transformers.LlamaForCausalLM(model.config).eval()
    ref.load_state_dict(want)
    assert torch.equal(back(ids).logits, ref(ids).logits)
    assert "float baseline written to" in capsys.readouterr().out


def test_save_float_refuses_a_users_folder_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert main(["quantize", "--out", str(tmp_path / "q"), "--save-float", str(tmp_path / "mine")]) == 2
    one_line_error(capsys, "--save-float", "not written by lowbit", "--overwrite")
    assert main(["quantize", "--out", str(tmp_path / "q"), "--save-float", str(tmp_path / "mine"), "--overwrite"]) == 2
    one_line_error(capsys, "--save-float", "config.json")               # lowbit would replace the user's file
    assert (tmp_path / "mine" / "config.json").read_text() == "{}" and not (tmp_path / "q").exists()


# ------------------------------------------------------------------ SIGTERM
_TERM_RUN = SLOW_WRITES + textwrap.dedent("""
    import sys, torch, transformers
    from lowbit.evaluation import workload
    from lowbit.entrypoints.main import main
    torch.manual_seed(int(sys.argv[2]))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (64,))
    workload.load_model = lambda spec: workload.Loaded("tiny", model, None, "causal")
    workload.prepare_texts = lambda loaded, tokens, calib, window, **k: workload.Texts(None, [ids[None, :32]], [])
    sys.exit(main(["quantize", "--plain", "--no-eval", "--recipe", "w8a16-int8", "--window", "32",
                   "--calib-tokens", "32", "--out", sys.argv[1]]))
""")


def test_sigterm_ends_like_ctrl_c_and_keeps_the_previous_checkpoint(tmp_path, seed):
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", _TERM_RUN, str(out)]
    # generous timeouts: a loaded CI machine may take minutes to import torch and transformers
    first = subprocess.run(cmd + [str(seed % 2**31), "fast"], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = subprocess.Popen(cmd + [str((seed + 1) % 2**31), "slow"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while not proc.stdout.readline().startswith("writing"):     # midway through the tensors
        pass
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "lowbit quantize: terminated (SIGTERM); an output being written was discarded", err
    assert "Traceback" not in err
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]                  # the staging directory removed


# ------------------------------------------------------------------ did you mean
@pytest.mark.parametrize("args, hint", [(["--recipe", "w4a16g32"], "did you mean w4a16-g32?"),
                                        (["--recipe", "W8A8_FP8"], "did you mean w8a8-fp8?"),
                                        (["--override-to", "nvfp"], "did you mean nvfp4?")])
def test_a_misspelt_recipe_gets_the_nearest_name(monkeypatch, capsys, args, hint):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    assert main(["quantize", *args]) == 2
    one_line_error(capsys, hint, "w8a8-int8, w8a8-int8-tensor")         # and the whole list


@pytest.mark.parametrize("flag, hint", [("--no-evl", "--no-eval"), ("--calibdata", "--calib-data"),
                                        ("--chat-tempalte=on", "--chat-template")])
def test_a_misspelt_flag_gets_the_nearest_flag(monkeypatch, capsys, flag, hint):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    with pytest.raises(SystemExit) as e:
        main(["quantize", flag])
    assert e.value.code == 2
    assert f"unrecognized arguments: {flag} (did you mean {hint}?)" in capsys.readouterr().err


def test_the_cache_layout_is_read_the_same_without_huggingface_hub(tmp_path, monkeypatch, rng):
    """huggingface_hub's resolution and lowbit's reading of the documented layout agree."""
    from lowbit.io.hub_cache import cached_model
    snap = _fake_cache(tmp_path, "acme/tiny", _model(rng))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert cached_model("acme/tiny") == snap
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)           # as if not installed
    assert cached_model("acme/tiny") == snap
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        cached_model("acme/none")
