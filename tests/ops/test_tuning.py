"""The per-GPU tuning table (lowbit.ops.tuning): buckets, reading and refusing tables, which path
dispatch takes with and without a cell, and what `lowbit doctor` says about it."""
import json

import pytest

from lowbit.ops import tuning


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.delenv("LOWBIT_TUNE_TABLE", raising=False)
    tuning.reset()
    yield
    tuning.reset()


def _table_dict(env, cells):
    return {"format": tuning.FORMAT, "environment": env, "cells": cells}


def _cell(kind="w4a16/int4/g128", N=64, K=128, bucket="1", path="dequant", config=None):
    return dict(op="linear", kind=kind, N=N, K=K, bucket=bucket, path=path, config=config, ratio=1.2, us={})


def test_buckets_cover_every_m_once():
    for lo, hi, name in tuning.BUCKETS:
        assert tuning.bucket(lo) == name
        if hi is not None:
            assert tuning.bucket(hi) == name and tuning.bucket(hi + 1) != name
        assert tuning.bucket(tuning.BUCKET_M[name]) == name   # `lowbit tune` times each bucket inside it
    assert tuning.bucket(10**6) == "513+"


def test_table_round_trip_and_lookup(tmp_path, monkeypatch):
    env = tuning.environment()
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table_dict(env, [_cell(), _cell(kind="w8a8/int8", bucket="2-16", path="kernel",
                                                                config=cfg)])))
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    table, why = tuning.active()
    assert table is not None and "2 cells" in why
    # a cell decides its exact (kind, N, K, bucket); anything else takes the heuristic
    assert tuning.choose("linear", "w4a16/int4/g128", 64, 128, 1) == ("dequant", None)
    assert tuning.choose("linear", "w4a16/int4/g128", 64, 128, 2) == ("kernel", None)
    assert tuning.choose("linear", "w4a16/int4/g128", 64, 256, 1) == ("kernel", None)
    assert tuning.choose("linear", "w8a8/int8", 64, 128, 9) == ("kernel", cfg)
    tuning.save_table(table, tmp_path / "again.json")
    again = tuning.load_table(tmp_path / "again.json")
    assert again.cells == table.cells and again.environment == table.environment


@pytest.mark.parametrize("field,value", [("gpu", "Some Other GPU"), ("torch", "0.0.1"), ("triton", "0.1"),
                                         ("capability", "1.0"), ("cuda", "99.9")])
def test_table_from_another_machine_is_refused(tmp_path, monkeypatch, field, value):
    env = dict(tuning.environment(), **{field: value})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table_dict(env, [_cell()])))
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    table, why = tuning.active()
    assert table is None and "refused" in why and field in why and "heuristic" in why
    assert tuning.choose("linear", "w4a16/int4/g128", 64, 128, 1) == ("kernel", None)   # the heuristic's


def test_the_driver_is_checked_where_both_record_it(tmp_path, monkeypatch):
    """A table that records a driver is refused on another one; one that does not (the shipped H200 table was
    written before tune recorded it) is not checked for it."""
    monkeypatch.setattr(tuning, "environment", lambda: {**dict.fromkeys(tuning.ENV_KEYS, "x"), "driver": "580.1"})
    path = tmp_path / "t.json"
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    for recorded, applies in (("570.9", False), ("580.1", True), (None, True)):
        env = {**dict.fromkeys(tuning.ENV_KEYS, "x"), **({} if recorded is None else {"driver": recorded})}
        path.write_text(json.dumps(_table_dict(env, [_cell()])))
        tuning.reset()
        table, why = tuning.active()
        assert (table is not None) == applies, why
        if not applies:
            assert "driver '570.9' (here '580.1')" in why


@pytest.mark.parametrize("text,word", [("{", "not JSON"), ('{"format": "other"}', "not a lowbit tuning table"),
                                       ('{"format": "lowbit-tune/1", "environment": {}}', "environment"),
                                       (None, "malformed"), ("bucket", "bucket")])
def test_bad_tables_name_the_problem(tmp_path, monkeypatch, text, word):
    env = tuning.environment()
    if text is None:
        text = json.dumps(_table_dict(env, [{"op": "linear"}]))
    elif text == "bucket":
        text = json.dumps(_table_dict(env, [_cell(bucket="3-7")]))
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=word):
        tuning.load_table(path)
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    table, why = tuning.active()
    assert table is None and word in why
    with pytest.raises(ValueError, match="cannot read"):
        tuning.load_table(tmp_path / "missing.json")


def _grouped(kind, bucket="1", path="dequant"):
    return dict(_cell(kind=kind, bucket=bucket, path=path), op="grouped")


def test_grouped_cells_without_a_weight_format_are_refused(tmp_path, monkeypatch, capsys):
    """Grouped cells keyed by a 4-bit kind alone ("w4a16/E8", as tables were written before the keys
    named the weight format) would apply one format's measurement to every format: reading the table
    refuses them with the reason (active()'s line, `lowbit doctor`), the heuristic decides those layers,
    and the rest of the table (dense cells, 8-bit grouped cells, format-named grouped cells) applies."""
    import torch

    from lowbit.entrypoints import doctor
    from lowbit.ops.kernels.grouped import GroupedW4A16
    from lowbit.recipes.presets import get_recipe
    env = tuning.environment()
    path = tmp_path / "t.json"
    cells = [_cell(), _grouped("w4a16/E8"), _grouped("fp4/E8"), _grouped("w4a16/int4/g128"),
             _grouped("int8/E8", path="kernel"), _grouped("w4a16/int4/g32/E8", bucket="513+", path="kernel")]
    path.write_text(json.dumps(_table_dict(env, cells)))
    table = tuning.load_table(path)
    assert set(table.cells) == {("linear", "w4a16/int4/g128", 64, 128, "1"), ("grouped", "int8/E8", 64, 128, "1"),
                                ("grouped", "w4a16/int4/g32/E8", 64, 128, "513+")}
    assert set(table.refused) == {"w4a16/E8", "fp4/E8", "w4a16/int4/g128"}
    assert "no weight format" in table.refused["w4a16/E8"] and "not a grouped key" in table.refused["w4a16/int4/g128"]
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    table, why = tuning.active()
    assert "3 cells" in why and "refused" in why and "'w4a16/E8'" in why and "lowbit tune --moe" in why
    # the refused "dequant" cell would have sent one token to the bf16 path; the heuristic keeps the kernel
    w4 = get_recipe("w4a16").weight
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 1, torch.bfloat16) is GroupedW4A16
    # the int4 g32 cell applies to int4 g32 only (the heuristic would take the bf16 path at 513+ rows)
    g32 = get_recipe("w4a16-g32").weight
    assert GroupedW4A16.for_rows(g32, 8, 64, 128, 4096, torch.bfloat16) is GroupedW4A16
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 4096, torch.bfloat16) is GroupedW4A16.dequant
    assert doctor.run(type("A", (), {"json": False})()) == 0
    assert "'w4a16/E8'" in capsys.readouterr().out


def test_grouped_kind_key_names_the_format_of_the_4bit_kinds():
    from lowbit.ops.w4_formats import W4Format
    assert tuning.grouped_kind_key("w4a16", 8, W4Format("int4", 128)) == "w4a16/int4/g128/E8"
    assert tuning.grouped_kind_key("w4a16", 8, W4Format("int4", 32, zero=True)) == "w4a16/int4/g32/zp/E8"
    assert tuning.grouped_kind_key("fp4", 128, W4Format("mxfp4", 32)) == "fp4/mxfp4/g32/E128"
    assert tuning.grouped_kind_key("int8", 8) == "int8/E8"
    with pytest.raises(ValueError, match="weight format"):
        tuning.grouped_kind_key("w4a16", 8)
    with pytest.raises(ValueError, match="weight format"):
        tuning.grouped_kind_key("fp8", 8, W4Format("int4", 128))
    with pytest.raises(ValueError, match="group size 16"):
        W4Format("nvfp4", 32)
    with pytest.raises(ValueError, match="no zero points"):
        W4Format("mxfp4", 32, zero=True)
    with pytest.raises(ValueError, match="grouped kernels take"):
        W4Format("uint4", 128)


def test_heuristic_prefers_the_bf16_path_past_small_batches():
    for kind in ("w4a16/int4/g128", "w8a16", "fp4/nvfp4/g16", "mxfp8"):
        assert [tuning.heuristic(kind, m) for m in (1, 16, 64, 65, 4096)] == ["kernel"] * 3 + ["dequant"] * 2
    assert {tuning.heuristic("w8a8/int8", m) for m in (1, 65, 4096)} == {"kernel"}


def test_doctor_reports_the_table_and_its_paths(tmp_path, monkeypatch, capsys):
    from lowbit.entrypoints import doctor
    env = dict(tuning.environment(), gpu="Some Other GPU")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table_dict(env, [_cell()])))
    monkeypatch.setenv("LOWBIT_TUNE_TABLE", str(path))
    assert doctor.run(type("A", (), {"json": False})()) == 0
    out = capsys.readouterr().out
    assert "refused" in out and "Some Other GPU" in out and "M 65-512: dequant" in out
    tuning.reset()
    env = tuning.environment()
    path.write_text(json.dumps(_table_dict(env, [_cell(), _cell(K=256, path="kernel")])))
    rep = doctor.tuning_report()
    assert rep["source"] == "table" and rep["paths"]["w4a16/int4/g128"]["1"] == "dequant x1 / kernel x1 1.20x"


def test_shipped_tables_are_valid_and_cover_the_tuned_shapes():
    """Every table lowbit ships reads back (format, environment, cells) and names a real path for
    each recipe kind at each Llama-3-8B shape and M bucket `lowbit tune` measures by default."""
    from lowbit.bench.tune import SHAPES
    shipped = sorted(tuning.TABLES_DIR.glob("*.json"))
    assert shipped, "lowbit ships the H200's table"
    for path in shipped:
        table = tuning.load_table(path)
        assert tuning.shipped_path(table.environment["gpu"]) == path
        kinds = {c.kind for c in table.cells.values() if c.op == "linear"}
        assert {"w4a16/int4/g128", "w8a16", "w8a8/int8", "w8a8/fp8_e4m3fn"} <= kinds
        for kind in kinds:
            for _, K, N in SHAPES["8b"]:
                for b in tuning.BUCKET_NAMES:
                    cell = table.cells[("linear", kind, N, K, b)]
                    assert cell.path in tuning.PATHS and cell.ratio > 0 and cell.us
