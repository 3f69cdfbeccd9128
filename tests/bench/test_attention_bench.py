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
    dec = [r for r in rows if r["bench"] == "decode" and r["kv"] == "fp8"]
    assert dec and all(r["bytes_vs_bf16"] < 0.51 for r in dec)       # one byte per value + 2 scales vs two
    assert all(r["us"] > 0 for r in rows)


def test_rows_on_the_interpreter_with_tiny_shapes(monkeypatch):
    """The code path (caches, specs, kernel calls, row fields) on tiny shapes, timings stubbed."""
    # the GPU where there is one (the compiled kernels), else the CPU under TRITON_INTERPRET
    monkeypatch.setattr(attention, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(attention, "HQ", 4)
    monkeypatch.setattr(attention, "HKV", 2)
    monkeypatch.setattr(attention, "D", 16)
    monkeypatch.setattr(attention, "DECODE", [(2, 40), (1, 40)])
    monkeypatch.setattr(attention, "PREFILL", [(1, 20)])
    calls = []

    def once(fn, inputs, **kw):
        calls.append(fn(*inputs[0]))
        return 1.0
    monkeypatch.setattr("lowbit.profiling.timing.bench_ms", once)
    rows = attention.run(None, quick=True)
    assert {r["bench"] for r in rows} == {"decode", "prefill"}
    assert all(torch.isfinite(c.float()).all() for c in calls)
    fp8 = [r for r in rows if r["kv"] == "fp8" and r["bench"] == "decode"]
    assert fp8 and all(r["bytes_vs_bf16"] < 0.51 for r in fp8)
