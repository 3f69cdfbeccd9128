"""`lowbit quantize` and `lowbit sites` on a mixture-of-experts model (a tiny random Mixtral
standing in for a model directory): GPTQ per expert with its few-token list in the summary, and
the routing report (flips, expert load, per-expert SQNR) with its PNG."""
import pytest
import torch

from lowbit.entrypoints.main import main
from moe_fixtures import tiny_moe

transformers = pytest.importorskip("transformers")


@pytest.fixture
def moe_cli(monkeypatch, rng):
    from lowbit.evaluation import workload as pipeline
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    ids = torch.randint(0, 97, (160,), generator=rng)
    monkeypatch.setattr(pipeline, "load_model", lambda spec: pipeline.Loaded("tiny-mixtral", model, None, "causal"))
    monkeypatch.setattr(pipeline, "prepare_texts", lambda loaded, tokens, calib, window, **data: pipeline.Texts(
        ids[:tokens], [ids[None, :window], ids[None, window:2 * window]], [ids[None, -window:]]))
    return ["--tokens", "64", "--calib-tokens", "64", "--window", "32"]


def test_quantize_gptq_report_has_experts_and_routing(moe_cli, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", *moe_cli, "--recipe", "w4a16-g32", "--gptq", "--no-save", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    md = (out / "lowbit_report.md").read_text()
    for text in (printed, md):
        assert "routed calibration tokens (expert: tokens)" in text      # the few-token rule's list
        assert "top-k set changed (router high precision)" in text
        assert "model.layers.1.mlp.experts" in text
    assert "## MoE routing" in md and "![MoE routing" in md and "Expert load" in md
    assert (out / "lowbit_routing.png").stat().st_size > 0


def test_sites_prints_routing_and_writes_its_png(moe_cli, tmp_path, capsys):   # moe_cli: the model and texts
    png, mdp = tmp_path / "s.png", tmp_path / "s.md"
    assert main(["sites", "--tokens", "64", "--window", "32", "--recipe", "w8a8-int8", "--png", str(png), "--markdown", str(mdp)]) == 0
    printed = capsys.readouterr().out
    assert "== MoE routing, w8a8-int8" in printed and f"routing plot: {tmp_path / 's_routing.png'}" in printed
    assert (tmp_path / "s_routing.png").stat().st_size > 0
    md = mdp.read_text()
    assert "## MoE routing, w8a8-int8" in md and "(router quantized)" in md


def test_quantize_awq_folds_the_experts_down_side_and_says_what_not(moe_cli, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", *moe_cli, "--recipe", "w4a16-g32", "--awq", "--no-save", "--no-eval",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "AWQ folded into the down side of" in printed and "gate_up, attention and shared experts are not" \
        in printed


def test_quantize_smoothquant_on_moe_folds_the_experts_down_side(moe_cli, tmp_path, capsys):
    assert main(["quantize", *moe_cli, "--recipe", "w8a8-int8", "--smoothquant", "0.5", "--no-save", "--no-eval",
                 "--out", str(tmp_path / "q")]) == 0
    printed = capsys.readouterr().out
    assert "SmoothQuant (alpha 0.5) folded into the down side of" in printed and "not smoothed" in printed
