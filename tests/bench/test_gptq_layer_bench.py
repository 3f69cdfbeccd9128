"""benchmarks/gptq_layer.py (GPTQ of 8B-shaped layers on a GPU, extrapolated to 32 layers) at a
size the CPU runs in seconds: it quantizes two layers, extrapolates the second one's time, and
its GPTQ phases are those of the layer-by-layer pipeline."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")


def test_gptq_layer_bench_runs_small(tmp_path, rng):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gptq_layer.py")
    spec = importlib.util.spec_from_file_location("gptq_layer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    layers = int(rng.initial_seed() % 7) + 2
    out = tmp_path / "r.json"
    assert mod.main(["--device", "cpu", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "2",
                     "--vocab", "128", "--sequences", "2", "--seq-len", "40", "--threads", "1",
                     "--model-layers", str(layers), "--work", str(tmp_path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 80 and r["model_layers"] == layers
    assert r["extrapolated_seconds"] == r["seconds_per_layer"] * layers > 0
    assert {"gptq_hessian", "gptq_factor", "gptq_solve", "gptq_losses"} <= set(r["phases"])
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]       # the checkpoints were removed
