"""`lowbit quantize --kv-cache`: refused before loading when misnamed; on a tiny random Llama the
report gives the metrics with and without the quantized cache and the checkpoint carries it."""
import json
import os
import re

import pytest
import torch

from lowbit.entrypoints.main import main
from cli_fixtures import no_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("value, why", [("fp7", "--kv-cache: kv_cache='fp7': unknown format"),
                                        ("int4", "--kv-cache: kv_cache='int4' needs a group size")])
def test_bad_kv_cache_refused_before_loading(monkeypatch, tmp_path, capsys, value, why):
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(["quantize", "--kv-cache", value]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_kv_cache_run_reports_both_and_saves_the_scheme(tiny, tmp_path, capsys):
    out = tmp_path / "q"
    assert main([*tiny, "--plain", "--kv-cache", "fp8-head", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("KV cache fp8-head:"))
    assert "with the KV cache unquantized" in line and line.count("top-1 agreement") == 2
    with_kv, without = (float(x) for x in re.findall(r"perplexity (\d+\.\d+)", line))
    cost = float(re.search(r"own cost: ([-+]\d+\.\d\d)% perplexity", line).group(1))
    # the printed perplexities (>= 1) are rounded to 1e-4, at most 1e-4 of the ratio together (0.01
    # points), and the cost to 0.005 points
    assert abs(cost - 100 * (with_kv / without - 1)) <= 0.015, line
    report = (out / "lowbit_report.md").read_text()
    assert line in report and "Attention sites (KV cache" in report and "| layer | K SQNR dB |" in report
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head"
    from lowbit.pipelines.checkpoint import load_compressed
    assert load_compressed(out).kv_cache.scheme.granularity == "head"
