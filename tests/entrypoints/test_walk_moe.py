"""A new user's walk through `lowbit quantize` on mixture-of-experts models: `--ignore` naming an
experts module (as docs/moe.md says it may), a recipe whose group does not divide the experts' K
(refused before calibration, with --no-save too, in the CLI's own flags), gpt-oss refused before
calibration when it cannot be saved, and the routing report with some experts kept in float."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.io.st_format import checkpoint_files, read_header
from moe_fixtures import tiny_moe

transformers = pytest.importorskip("transformers")

ARGS = ["--tokens", "64", "--calib-tokens", "32", "--window", "32", "--plain", "--no-eval"]


def _no_texts(*a, **k):
    raise AssertionError("calibration text was prepared before the plan was checked")


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("lowbit quantize: error:"), err
    for w in words:
        assert w in last, last
    return last


@pytest.fixture
def moe(monkeypatch, rng):
    """Returns make(family): `lowbit quantize` then runs on a tiny random model of that family
    (4 experts, H = I = 64) and random token windows."""
    from lowbit.evaluation import workload

    def make(family):
        model = tiny_moe(family, rng, dtype=torch.float32, experts=4)
        ids = torch.randint(0, 97, (96,), generator=rng)
        monkeypatch.setattr(workload, "load_model", lambda spec: workload.Loaded(f"tiny-{family}", model, None,
                                                                                 "causal"))
        monkeypatch.setattr(workload, "prepare_texts", lambda loaded, tokens, calib, window, **d: workload.Texts(
            ids[:tokens], [ids[None, :window]], [ids[None, -window:]]))
        return model
    return make


def test_ignore_naming_an_experts_module_is_accepted_and_saved_in_float(moe, tmp_path, capsys):
    moe("mixtral")
    out = tmp_path / "o"
    assert main(["quantize", *ARGS, "--recipe", "w4a16-g32", "--ignore", "model.layers.0.mlp.experts",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 of 2 experts modules quantized" in printed
    assert "model.layers.0.mlp.experts: skipped (ignore pattern 'model.layers.0.mlp.experts')" in printed
    header = {}
    for f in set(checkpoint_files(out).values()):
        header.update(read_header(f)[0])     # name -> (dtype, shape, begin, end)
    for p in ("w1", "w2", "w3"):     # layer 0's experts in float, layer 1's packed int4
        assert header[f"model.layers.0.block_sparse_moe.experts.2.{p}.weight"][0] == torch.float32
        assert f"model.layers.1.block_sparse_moe.experts.2.{p}.weight_packed" in header
    md = (out / "lowbit_report.md").read_text()
    # the kept layer's routing is still reported (its flips come from the layers before it)
    assert "| model.layers.0.mlp.experts |" in md and "kept in high precision" in md


def test_a_misspelt_experts_pattern_is_still_refused(moe, monkeypatch, tmp_path, capsys):
    moe("mixtral")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", _no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--ignore", "model.layers.0.mlp.expertz",
                 "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "'model.layers.0.mlp.expertz'", "matches no")


@pytest.mark.parametrize("save", [True, False])
def test_experts_group_not_dividing_k_refused_before_calibration(moe, monkeypatch, tmp_path, capsys, save):
    """H = I = 64 under w4a16's groups of 128: refused before any calibration, in the CLI's flags,
    naming the recipe that fits, saved or not (experts take whole groups only)."""
    moe("qwen3_moe")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", _no_texts)
    argv = ["quantize", *ARGS, "--recipe", "w4a16", "--out", str(tmp_path / "o")]
    assert main(argv + ([] if save else ["--no-save"])) == 2
    last = _one_line_error(capsys, "--recipe w4a16", "w4a16-g32")
    if not save:
        assert "--ignore 'model.layers.*.mlp.experts'" in last and "ignore=[" not in last


def test_gpt_oss_refused_before_calibration_when_saving_then_saved_with_its_experts_ignored(
        moe, monkeypatch, tmp_path, capsys):
    moe("gpt_oss")
    from lowbit.evaluation import workload
    texts = workload.prepare_texts
    monkeypatch.setattr(workload, "prepare_texts", _no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--out", str(tmp_path / "a")]) == 2
    _one_line_error(capsys, "--recipe w8a8-int8", "gpt_oss", "--ignore 'model.layers.*.mlp.experts'", "--no-save")
    monkeypatch.setattr(workload, "prepare_texts", texts)
    out = tmp_path / "b"
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--ignore", "model.layers.*.mlp.experts",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0 of 2 experts modules quantized" in printed and (out / "config.json").is_file()
    assert "MoE routing" not in (out / "lowbit_report.md").read_text()    # no experts quantized: no routing report
