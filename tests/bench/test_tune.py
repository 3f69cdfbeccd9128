"""`lowbit tune`'s candidates: every W8A8 tile alternative it may pick computes what the default
tiles compute (int8: bit for bit; the interpreter runs each configuration at a shape that is no
tile multiple), and the command refuses to run without a GPU."""
import pytest
import torch

from lowbit.bench import tune
from lowbit.ops.grouped_configs import GroupedConfig
from lowbit.ops import tuning
from lowbit.ops.w4_formats import W4Format


def test_candidates_per_kind():
    assert tune.candidates("w4a16/int4/g128", "1") == [("kernel", None), ("dequant", None)]
    for b in tuning.BUCKET_NAMES:
        c = tune.candidates("w8a8/int8", b)
        assert c[0] == ("kernel", None) and all(p == "kernel" for p, _ in c)


def test_fp8_prefill_paths_are_candidates_where_they_can_run(monkeypatch):
    """From 65 rows the fp8 kind also times torch._scaled_mm and the CUTLASS GEMM's precise configurations (never the
    fast-accumulation ones, whose arithmetic differs), each only where this machine can run it."""
    from lowbit.ops.kernels.dense_w8 import CutlassW8A8Fp8, ScaledMMW8A8Fp8
    from lowbit.ops.native.prefill import ROWWISE_CONFIGS

    precise = [i for i, c in enumerate(ROWWISE_CONFIGS) if not c.fast_accum]
    assert precise and len(precise) < len(ROWWISE_CONFIGS)
    for why in (None, "not here"):
        monkeypatch.setattr(ScaledMMW8A8Fp8, "usable", classmethod(lambda cls, w=why: w))
        monkeypatch.setattr(CutlassW8A8Fp8, "usable", classmethod(lambda cls, w=why: w))
        for b in tuning.BUCKET_NAMES:
            extra = [c for c in tune.candidates("w8a8/fp8_e4m3fn", b) if c[0] != "kernel"]
            want = [("scaled_mm", None)] + [("cutlass", {"config": i}) for i in precise]
            assert extra == (want if why is None and b in ("65-512", "513+") else [])
            assert all(p == "kernel" for p, _ in tune.candidates("w8a8/int8", b))


@pytest.mark.parametrize("bucket", [b for b in tuning.BUCKET_NAMES if tune.W8A8_TILES[b]])
def test_w8a8_tile_alternatives_are_bit_identical(rng, bucket, kernel_device):
    from lowbit.ops.triton.gemm_int8 import launch_int8_gemm
    M, N, K = 5, 70, 300
    a = torch.randint(-127, 128, (M, K), generator=rng, dtype=torch.int8)
    b = torch.randint(-127, 128, (N, K), generator=rng, dtype=torch.int8)
    sa, sb = torch.rand(M, generator=rng) + 0.01, torch.rand(N, generator=rng) + 0.01
    exact = ((a.double() @ b.double().T) * sa.double()[:, None] * sb.double()[None, :])
    a, b, sa, sb = (t.to(kernel_device) for t in (a, b, sa, sb))
    ref = launch_int8_gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16, device=kernel_device), sa, sb, None, None,
                           None)
    # the default is right: the exact int32 sum, two fp32 scale products, one rounding to bf16
    assert (ref.double().cpu() - exact).abs().max() <= 2.0 ** -8 * exact.abs().max()
    for cfg in (c for c in tune.W8A8_TILES[bucket] if "FUSED_QUANT" not in c):   # the fused: test_w8a8_small
        y = launch_int8_gemm(a, b, torch.empty(M, N, dtype=torch.bfloat16, device=kernel_device), sa, sb, None,
                             None, None, config=cfg)
        assert torch.equal(y, ref), cfg


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match="CUDA GPU"):
        tune.run_tune("tiny")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal runs the kernels in the CPU interpreter")
def test_tune_rehearsal_on_the_cpu(monkeypatch, tmp_path):
    """The tuner's loops end to end in Triton's interpreter at tiny shapes (CUDA-graph timing replaced
    by a stand-in that runs each candidate once and times it on the host): every cell it writes
    names a candidate that ran, the table round-trips, and dispatch then takes the winners' paths.
    Grouped cells time the W4A16 kernel's configurations and its bf16 path (the experts' weights
    dequantized into the scratch buffer, torch._grouped_mm) against the grouped bf16 GEMM, one cell per
    kernel and weight format (int4 g128 with zero points, NVFP4), keyed by it."""
    import time

    def host_us(fn, reps=1):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    monkeypatch.setattr(tune, "_graph_us", host_us)
    timed = set()       # (kind, 4-bit weight format) of every grouped case the tuner built

    def grouped_case(kind, *a, weight=None, **kw):
        timed.add((kind, weight))
        return make_case(kind, *a, weight=weight, **kw)
    make_case = tune.grouped_case
    monkeypatch.setattr(tune, "grouped_case", grouped_case)
    monkeypatch.setattr(tune, "MOE_TOKENS", (1,))
    monkeypatch.setattr(tune, "ATTN_T", {"65-512": 80, "513+": 80})
    monkeypatch.setattr(tune, "GROUPED_MAX_CANDIDATES", 2)
    monkeypatch.setitem(tune.SHAPES, "tiny", tune.SHAPES["tiny"][:1])
    from lowbit.ops import attention as attn
    every = attn.prefill_options
    monkeypatch.setattr(attn, "prefill_options", lambda *a: every(*a)[:1] + every(*a)[-2:])  # a tiling, flash, sdpa
    log = []
    try:
        cells = tune.tune_linear("tiny", ("w4a16", "w8a8-int8"), ("1",), log.append, device="cpu")
        cells += tune.tune_attention("tiny", ("65-512",), log.append, device="cpu")
        cells += tune.tune_grouped("tiny", ("w8a8-int8", "w4a16-asym", "nvfp4"), log.append, device="cpu")
    finally:
        tuning.reset()
    ops = {c.op for c in cells}
    assert ops == {"linear", "attention", "grouped"}, log
    assert len([c for c in cells if c.op == "linear"]) == 2      # 1 shape x 2 recipes x 1 bucket
    for c in cells:
        if c.op == "linear":        # the winner is the fastest candidate that ran; its ratio is to bf16's time
            won = tune._label(c.path, c.config)
            assert c.us[won] == min(t for k, t in c.us.items() if k != "bf16"), c
        elif c.op == "grouped":     # against torch._grouped_mm over bf16 weights
            won = tune._label(c.path, None if c.config is None else GroupedConfig.from_dict(c.config))
            assert c.us[won] == min(t for k, t in c.us.items() if k != "bf16"), c
        if c.op in ("linear", "grouped"):
            # the ratio is of the unrounded times, rounded to 3 decimals (<= 5e-4); the times are
            # kept to 0.01 us (host times here: >= 1 us, so each within 1%: the quotient within ~2%)
            assert abs(c.ratio - c.us["bf16"] / c.us[won]) <= 5e-4 + 0.02 * c.ratio, c
            assert ("dequant" in c.us) == c.kind.startswith(("w4a16/", "fp4/")), c
        else:
            assert c.us and c.ratio is not None, c
    table = tuning.Table(tuning.environment(), {(c.op, c.kind, c.N, c.K, c.bucket): c for c in cells})
    tuning.save_table(table, tmp_path / "t.json")
    assert tuning.load_table(tmp_path / "t.json").cells == table.cells
    assert "w8a8/int8" in tune.summary(table)
    assert {c.kind for c in cells if c.op == "grouped"} == {"int8/E4", "w4a16/int4/g128/zp/E4", "fp4/nvfp4/g16/E4"}
    assert len([c for c in cells if c.op == "grouped"]) == 3 * 2        # 3 keys x 2 projections x 1 token count
    # each cell's format is the one timed: int4 g128 with zero points, NVFP4 (16-element blocks)
    assert timed == {("int8", None), ("w4a16", W4Format("int4", 128, zero=True)), ("fp4", W4Format("nvfp4", 16))}


def test_tune_cli_checks_the_moe_recipes_before_measuring():
    """`lowbit tune --moe-recipes` names the recipes whose grouped kernels (and weight formats) are timed;
    an unknown one is refused before anything is measured."""
    import argparse

    from lowbit.entrypoints import tune as cli
    p = argparse.ArgumentParser()
    cli.register(p)
    with pytest.raises(ValueError, match="no-such-recipe"):
        cli.run(p.parse_args(["--moe-recipes", "w4a16,no-such-recipe"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal stands a CPU twin in for the GPU")
def test_tune_native_rehearsal_on_the_cpu(monkeypatch):
    """tune_native's loops on the CPU: an H200 stands in as the kernel device, the CPU twin for the native
    GEMV (the twin runs nt / prefetch; the fixup only changes who adds the splits) and the dequantization, host
    times for CUDA-graph replays. Every variant is timed against the weight-only class's dequant path and bf16
    at each bucket its GEMV may run in (17-64: 16 rows a launch); the cell takes the fastest; a variant whose
    output is not the default launch's bits (here nt = 4, made to differ) is dropped."""
    import time

    from lowbit.ops.kernels import dense
    from lowbit.ops.kernels.base import Device
    from lowbit.ops.native import kernels as nk
    from lowbit.ops.native import library

    def host_us(fn, reps=1):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def launch(x, w, splits=None, bias=None, nt=1, prefetch=False, fixup=False, out=None):
        y = nk.twin_w4a16(x, w, splits or 1, bias=bias, nt=nt, prefetch=prefetch)
        y = y * 2 if nt == 4 else y          # a broken variant
        return y if out is None else out.copy_(y)
    monkeypatch.setattr(tune, "_graph_us", host_us)
    monkeypatch.setattr(library, "unavailable_reason", lambda: None)
    monkeypatch.setattr(dense, "kernel_device", lambda: Device("cuda", (9, 0)))
    monkeypatch.setattr(nk, "w4a16", launch)
    monkeypatch.setattr(nk, "dequantize", lambda w, dtype, out=None: out.copy_(nk.twin_dequantize(w, dtype)))
    monkeypatch.setitem(tune.SHAPES, "tiny", tune.SHAPES["tiny"][:1])
    log = []
    try:
        cells = tune.tune_native("tiny", ("w4a16", "mxfp8"), ("1", "17-64", "513+"), log.append, device="cpu")
    finally:
        tuning.reset()
    # one recipe with a native class; its GEMV buckets among those asked for
    assert [(c.op, c.bucket) for c in cells] == [("native", "1"), ("native", "17-64")], log
    assert any("mxfp8: no native kernel" in line for line in log), log
    assert sum("nt=4" in line and "strays" in line for line in log) == 2, log    # the nt = 4 variant, both buckets
    labels = {tune._label("kernel", None)} | {tune._label("kernel", v) for v in tune.NATIVE_VARIANTS if v.get("nt") != 4}
    for c in cells:
        assert set(c.us) == labels | {"dequant", "bf16"}, c.us
        best = min((t, k) for k, t in c.us.items() if k != "bf16")
        assert (c.path == "dequant") == (best[1] == "dequant"), c
        if c.path == "kernel":
            assert tune._label("kernel", c.config) == best[1]
