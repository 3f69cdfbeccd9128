"""`lowbit quantize --lm-head`: refused with the paths that cannot do it before loading; on a tiny
random Llama the report gives the metrics with the quantized and with the float LM head, and the
checkpoint stores the head quantized (named in a config group, not ignored)."""
import json
import os

import pytest
import torch

from lowbit.entrypoints.main import main
from cli_fixtures import no_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("flags, why", [(["--lm-head", "int8", "--gptq"], "--lm-head with --gptq"),
                                        (["--lm-head", "int8", "--sequential", "--model", "."],
                                         "--lm-head is not available with --sequential")])
def test_bad_lm_head_refused_before_loading(monkeypatch, tmp_path, capsys, flags, why):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", *flags]) == 2
    err = capsys.readouterr().err
    assert why in err, err
    assert os.listdir(tmp_path) == []


def test_unknown_lm_head_kind_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--lm-head", "int4"])
    assert exc.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_lm_head_run_reports_both_and_saves_the_head(tiny, tmp_path, capsys, kind):
    out = tmp_path / "q"
    assert main([*tiny, "--plain", "--recipe", "w8a8-int8", "--lm-head", kind, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith(f"LM head {kind}"))
    assert "with the LM head in high precision" in line and line.count("top-1 agreement") == 2
    assert "lm_head 64x64: quantized as" in printed
    assert line in (out / "lowbit_report.md").read_text()
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qc["ignore"]
    assert any("lm_head" in g["targets"] for g in qc["config_groups"].values())
    from lowbit.pipelines.checkpoint import load_compressed
    ck = load_compressed(out)
    codes = ck.qtensors["lm_head"].codes
    assert codes.shape == (64, 64) and codes.element_size() == 1
    assert ck.qtensors["lm_head"].scheme.format == ("int8" if kind == "int8" else "fp8_e4m3fn")
    assert ck.act_schemes["lm_head"] is None and torch.isfinite(ck.qtensors["lm_head"].scale).all()
