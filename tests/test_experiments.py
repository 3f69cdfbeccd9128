"""The seeds' experiments, small: their qualitative results hold."""
import json

import numpy as np
import pytest

from lowbit.cli import main
from lowbit.experiments import error_model, layout, matmul, outliers
from lowbit.experiments.inputs import lcg_uniform, matmul_inputs


def test_lcg_matches_the_recurrence():
    x, want = 12345, []
    for _ in range(9000):  # crosses two jump-ahead blocks
        x = (1664525 * x + 1013904223) % 2 ** 32
        want.append(x / 2 ** 32)
    assert np.array_equal(lcg_uniform(9000, 12345), np.array(want))


def test_matmul_inputs_shape_the_seed_describes(seed):
    a, w = matmul_inputs(8, 74, 16, seed=seed)
    assert a.min() >= 0 and a.max() < 1
    b = w.T.numpy()  # [K, N] as in the seed
    ratio = np.abs(b[:, 0]).max() / np.abs(b[:, -1]).max()
    assert 16 < ratio < 256                       # 64x gain, give or take where the outliers land
    assert np.allclose(np.abs(b.reshape(-1)[::37]).mean() / np.abs(b).mean(), 8, rtol=0.5)


def test_matmul_qualitative_results(seed):
    table = {r["kernel"]: r for r in matmul.run(sizes=(192,), seed=seed)["rows"]}
    assert table["int8 one scale"]["sqrtk_frac"] > 1          # fails the sqrt(K) diagnostic
    for k in ("int8 per-column", "int8 per-col + zp", "int8 per-token A"):
        assert table[k]["sqrtk_frac"] < 1 and table[k]["k_gate_frac"] < 1
    assert table["int8 2:4 pruned"]["rms_err"] > 5 * table["int8 per-column"]["rms_err"]
    assert table["int8 one scale"]["codes_used_worst"] <= 8   # "3 of 255 codes used"
    # per-token pays on the input with one 20x row, not on the shipped one
    assert table["int8 per-token A, A 20x row"]["rms_err"] < 0.5 * table["int8 per-column, A 20x row"]["rms_err"]
    assert table["int8 per-token A"]["rms_err"] > 0.9 * table["int8 per-column"]["rms_err"]
    assert table["fp32 baseline"]["max_err"] < 1e-3 * table["int8 per-column"]["max_err"]


def test_error_model_accumulators_order(seed):
    rows = {r["accumulator"]: r["median_rel_err"] for r in error_model.experiment_c(K=1024, trials=8, seed=seed)}
    f16, f32 = rows["fp16 accumulate"], rows["fp32 accumulate"]
    split = next(v for k, v in rows.items() if k.startswith("split"))
    assert f32 < split < f16 and f16 / f32 > 1e3


def test_error_model_floats_follow_u_over_sqrtk(seed):
    rows = error_model.experiment_b(ks=(512,), trials=10, seed=seed)
    for r in rows:
        if r["format"] in ("fp16", "bf16", "fp8_e4m3fn"):
            assert 0.1 < r["ratio_to_u_over_sqrtK"] < 2


def test_layout_mistakes_are_logic_sized_and_one_group_hides(seed):
    rows = layout.run(M=8, K=256, N=12, seed=seed)["rows"]
    for r in rows[:3]:
        assert r["rel_l2"] > 0.1
    assert rows[3]["identical"] is True


def test_outliers_per_token_and_smoothing_help(seed):
    rows = {(r["outlier_channel"], r["x_scales"].split(" (")[0]): r["sqnr_db"]
            for r in outliers.run(tokens=8, K=512, N=64, seed=seed)["rows"]}
    assert rows[(True, "per-tensor")] < rows[(False, "per-tensor")] - 10
    assert rows[(True, "per-token + smoothing")] > rows[(True, "per-token")] + 3


def test_experiment_cli_json(capsys, tmp_path):
    png = tmp_path / "mm.png"
    assert main(["experiment", "matmul", "--json", "--sizes", "64,96", "--png", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {"size", "kernel", "max_err", "rms_err", "k_gate_frac", "sqrtk_frac"} <= set(rows[0])
    assert png.stat().st_size > 1000
    assert main(["experiment", "layout", "--sizes", "1"]) == 2
