"""The attention benchmark module: importable everywhere, refuses to run without CUDA (its rows
are GPU timings, taken on the H200 by `python -m lowbit.bench.attention --json ...`)."""
import pytest
import torch

from lowbit.bench import BENCH_MODULES, attention


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_cuda(capsys):
    assert attention.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert "lowbit.bench.attention" in BENCH_MODULES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_rows(tmp_path):
    rows = attention.run(None, quick=True)
    dec = [r for r in rows if r["bench"] == "decode" and r.get("kv") == "fp8"]
    assert dec and all(r["bytes_vs_bf16"] < 0.51 for r in dec)       # one byte per value + 2 scales vs two
    assert all(r["us"] > 0 for r in rows if "us" in r)
    assert any(r["bench"] == "step" and "vs_bf16" in r for r in rows), [r for r in rows if r["bench"] == "step"]


def test_rows_on_the_interpreter_with_tiny_shapes(monkeypatch):
    """The code path (caches, specs, kernel calls, row fields) on tiny shapes, timings stubbed."""
    # the GPU where there is one (the compiled kernels), else the CPU under TRITON_INTERPRET
    monkeypatch.setattr(attention, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(attention, "HQ", 4)
    monkeypatch.setattr(attention, "HKV", 2)
    monkeypatch.setattr(attention, "D", 32)             # HQ * D = 128: the o projection's K
    monkeypatch.setattr(attention, "DECODE", [(2, 40), (1, 40)])
    monkeypatch.setattr(attention, "PREFILL", [(1, 20)])
    monkeypatch.setattr(attention, "STEP", [(2, 40)])
    monkeypatch.setattr(attention, "STEP_LAYERS", 2)
    monkeypatch.setattr(attention, "HIDDEN", 128)      # w4a16's groups of 128 along every K
    monkeypatch.setattr(attention, "INTER", 128)
    monkeypatch.setattr(attention, "FP8_SPEC", {**attention.FP8_SPEC, "p_block": 16})
    calls = []

    def once(fn, inputs, **kw):
        calls.append(fn(*inputs[0]))
        return 1.0
    monkeypatch.setattr("lowbit.profiling.timing.bench_ms", once)
    rows = attention.run(None, quick=True)
    assert {r["bench"] for r in rows} == {"decode", "sweep", "step", "prefill", "must"}
    assert all(torch.isfinite(c.float()).all() for c in calls)
    fp8 = [r for r in rows if r.get("kv") == "fp8" and r["bench"] == "decode"]
    assert fp8 and all(r["bytes_vs_bf16"] < 0.51 for r in fp8)
    step = [r for r in rows if r["bench"] == "step"]
    assert {(r["weights"], r["kv"]) for r in step} == {("bf16", "bf16"), ("bf16", "fp8"), ("w4a16", "bf16"),
                                                       ("w4a16", "fp8")}, step
    assert all("error" not in r for r in step), step
    ratio = [r for r in step if "bound" in r]
    assert len(ratio) == 2 and all(1.0 < r["bound"] < 2.0 for r in ratio)     # (W + 2 KV8) / (W + KV8)
    pre = [r for r in rows if r["bench"] == "prefill" and r.get("kv") == "fp8"]
    assert all("error" not in r for r in pre), pre
    labels = {r["attn"] for r in pre}
    assert {"flash (general)", "sdpa over dequantized"} <= labels and any(a.startswith("prefill m") for a in labels)
    assert sum(bool(r.get("default")) for r in pre) == 1           # the heuristic's configuration is marked
    must = {r["target"]: r for r in rows if r["bench"] == "must"}
    assert must["attention prefill T=20, fp8 KV (fastest path) vs best bf16 SDPA"]["status"] in ("met", "missed")
    assert must["KV bytes fp8 vs bf16"]["status"] == "met"
    # codes two per byte plus one fp32 scale per group: 0.25 + 2 / g of bf16's bytes
    assert must["KV bytes int4-g32 (scales included) vs bf16"]["value"] == 0.25 + 2 / 32
    assert must["KV bytes int4-g32 (scales included) vs bf16"]["status"] == "missed"
    assert must["KV bytes int4-g64 (scales included) vs bf16"]["status"] == "met"
    assert all(r["status"] in ("met", "missed", "not measured") for r in must.values())
