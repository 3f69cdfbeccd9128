"""The grouped MoE kernels under several launch configs (lowbit.ops.grouped_configs): tiles from the
smallest to the candidate lists' largest, BLOCK_K below / equal to / above the scale group (int4's
running group partial, one group per dot pair, several per step), split-K, bf16 activations on the
tensor-core dots and bf16 outputs, at odd shapes (N, K and rows not tile multiples), against the
float64 grouped reference within check_grouped_linear's derived gate; int8 accumulators bit-exact."""
from dataclasses import replace

import pytest
import torch

import lowbit as lb
from lowbit.ops import tuning
from lowbit.ops.grouped import sort_tokens
from lowbit.ops.kernels.base import fp8_dot_accumulator
from lowbit.ops.kernels.grouped import GroupedFp4, GroupedW4A16
from lowbit.ops.grouped_configs import (KINDS, M_BUCKETS, GroupedConfig, check_config, grouped_candidates,
                                        grouped_config, grouped_default_config, m_bucket, register_grouped_table)
from lowbit.ops.triton.grouped import grouped_fp8, grouped_int8, grouped_w4a16, grouped_w8a16
from lowbit.ops.w4_formats import W4Format
from lowbit.packing import pack_fp4, pack_int4
from lowbit.recipes.presets import get_recipe
from lowbit.verify.grouped import check_grouped_linear
from moe_fixtures import top_k_index

DEV = "cuda" if torch.cuda.is_available() else "cpu"
C = GroupedConfig
SMALL, SPLIT, FLUSH, MID, LARGE = C(16, 16, 32, 4, 1), C(16, 32, 32, 4, 2, 2), C(32, 16, 32, 4, 3), \
    C(64, 128, 128, 4, 3), C(128, 256, 64, 8, 3)
NO_PREFETCH = C(16, 32, 32, 4, 2, 2, prefetch=0)      # SPLIT through Triton's pipeline instead of the register prefetch
# int4 g128 decode tiles (S = 128 codes a step: read as 8-code words, eight dots), one step and two steps per BLOCK_K
WORDS1, WORDS2 = C(16, 32, 128, 4, 2), C(16, 32, 256, 4, 2, 2, prefetch=0)
CONFIGS = [SMALL, SPLIT, NO_PREFETCH, FLUSH, MID, LARGE, WORDS1, WORDS2]


def _data(rng, T, E, N, K, dtype):
    x = (torch.randn(T, K, generator=rng) * torch.exp(torch.randn(T, 1, generator=rng))).to(dtype)
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    return x, w


def _stack(qs, field):
    return torch.stack([getattr(q, field) for q in qs])


def _check(out, x, w, routing, **kw):
    v = check_grouped_linear(out.cpu(), x.float()[routing.token], w, routing.offsets, **kw)
    assert v.passed, v.report()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: _id(c) + f"p{c.prefetch}")
@pytest.mark.parametrize("wkind,group", [("int4", 64), ("int4_asym", 32), ("int4", 128), ("int4_asym", 128),
                                         ("mxfp4", 32), ("nvfp4", 16)])
def test_w4a16_configs_within_gate(config, wkind, group, rng):
    """bf16 activations (the tensor-core dot); fp32 output (the tight gate) for the small tiles, bf16
    for the large ones; int4 g64 at BLOCK_K 32 accumulates each group over two steps before its scale."""
    T, E, N, K = 7, 3, 40, 192 if group < 128 else 384
    out_dtype = torch.bfloat16 if config.block_m >= 64 else torch.float32
    if wkind.startswith("int4"):
        scheme = lb.QuantScheme(format="int4", strategy="group", group_size=group, symmetric=wkind == "int4")
    else:
        scheme = get_recipe(wkind).weight
    x, w = _data(rng, T, E, N, K, torch.bfloat16)
    bias = torch.randn(E, N, generator=rng)
    idx = top_k_index(rng, T, E, 2, "hot")
    routing = sort_tokens(idx, E)
    wq = [lb.quantize(w[e], scheme) for e in range(E)]
    if wkind.startswith("int4"):
        zero = None if wkind == "int4" else _stack(wq, "zero_point").to(DEV)
        args = dict(kind="int4", group_size=group, w_zero=zero)
        packed, scale = torch.stack([pack_int4(q.codes) for q in wq]), _stack(wq, "scale")
    else:
        g = None if wq[0].global_scale is None else torch.stack([q.global_scale.reshape(()) for q in wq])
        args = dict(kind=wkind, w_global=None if g is None else g.to(DEV))
        packed, scale = torch.stack([pack_fp4(q.codes) for q in wq]), _stack(wq, "scale_codes")
    run = lambda c: grouped_w4a16(x.to(DEV), packed.to(DEV), scale.to(DEV), sort_tokens(idx.to(DEV), E),  # noqa: E731
                                  bias=bias.to(DEV), config=c, out_dtype=out_dtype, **args)
    out = run(config)
    assert out.dtype == out_dtype
    _check(out, x, w, routing, w_scheme=scheme, bias=bias, accumulator="fp32")
    if config.block_m <= 32:     # the register prefetch on or off: the same loads and sums, the same bits
        assert torch.equal(run(replace(config, prefetch=1 - int(config.uses_prefetch()))), out)


def _id(c):
    return f"{c.block_m}x{c.block_n}x{c.block_k}s{c.split_k}"


@pytest.mark.parametrize("config", [SMALL, SPLIT, LARGE], ids=_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w8a16_configs_within_gate(config, dtype, rng):
    """fp32 activations (IEEE fp32 products), bf16 / fp16 ones (codes exact there); fp32 output."""
    scheme = get_recipe("w8a16-int8").weight
    T, E, N, K = 9, 3, 24, 80
    x, w = _data(rng, T, E, N, K, dtype)
    idx = top_k_index(rng, T, E, 2, "sparse")
    routing = sort_tokens(idx, E)
    wq = [lb.quantize(w[e], scheme) for e in range(E)]
    out = grouped_w8a16(*[t.to(DEV) for t in (x, _stack(wq, "codes"), _stack(wq, "scale"))],
                        sort_tokens(idx.to(DEV), E), config=config)
    _check(out, x, w, routing, w_scheme=scheme, accumulator="fp32")


@pytest.mark.parametrize("config", [SMALL, MID, C(128, 128, 128, 8, 3)], ids=_id)
def test_w8a8_configs_int8_bit_exact_fp8_within_gate(config, rng):
    T, E, N, K = 11, 5, 40, 96
    idx = top_k_index(rng, T, E, 2, "dropped")
    routing, on_dev = sort_tokens(idx, E), sort_tokens(idx.to(DEV), E)
    a = torch.randint(-127, 128, (T, K), generator=rng, dtype=torch.int8)
    wc = torch.randint(-127, 128, (E, N, K), generator=rng, dtype=torch.int8)
    raw = grouped_int8(a.to(DEV), torch.ones(T, device=DEV), wc.to(DEV), torch.ones(E, N, device=DEV), on_dev,
                       raw=True, config=config).cpu()
    want = torch.einsum("mk,mnk->mn", a[routing.token].long(), wc[routing.expert_of_rows()].long())
    assert torch.equal(raw.long(), want)
    r = get_recipe("w8a8-fp8")
    x, w = _data(rng, T, E, N, K, torch.float32)
    xq, wq = lb.quantize(x, r.act), [lb.quantize(w[e], r.weight) for e in range(E)]
    out = grouped_fp8(*[t.to(DEV) for t in (xq.codes, xq.scale, _stack(wq, "codes"), _stack(wq, "scale"))], on_dev,
                      config=config, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    _check(out, x, w, routing, x_scheme=r.act, w_scheme=r.weight, accumulator=fp8_dot_accumulator(DEV))


def test_candidates_are_valid_small_and_start_with_the_default():
    for kind in KINDS:
        for E, N, K in ((8, 28672, 4096), (8, 4096, 14336), (128, 1536, 2048), (128, 2048, 768)):
            for b in range(len(M_BUCKETS)):
                cands = grouped_candidates(kind, E, N, K, b)
                assert 2 <= len(cands) <= 8 and len(set(cands)) == len(cands)
                for c in cands:
                    check_config(kind, c, K, 32)
            for M in (1, 2, 16, 17, 64, 512, 4096, 16384):
                c = grouped_default_config(kind, E, N, K, M)
                check_config(kind, c, K, 128)
    assert grouped_default_config("w4a16", 8, 4096, 14336, 2) == C(16, 64, 128, 4, 4, 4)     # Mixtral down, b1
    assert grouped_default_config("w4a16", 8, 28672, 4096, 2).split_k == 1                    # 896 programs
    assert grouped_default_config("int8", 8, 4096, 14336, 2).split_k == 1
    assert grouped_default_config("int8", 8, 4096, 14336, 4096).block_m == 128
    assert [m_bucket(m) for m in (1, 2, 16, 17, 64, 65, 512, 513)] == [0, 1, 1, 2, 2, 3, 3, 4]


def test_registered_table_wins_and_bad_configs_are_refused():
    mine = C(32, 64, 64, 4, 2)
    register_grouped_table(lambda key, N, K, M: mine if key == "w8a16/E8" else None)
    try:
        assert grouped_config("w8a16", 8, 64, 64, 3) == mine
        assert grouped_config("int8", 8, 64, 64, 3) == grouped_default_config("int8", 8, 64, 64, 3)
    finally:
        register_grouped_table(None)
    assert grouped_config("w8a16", 8, 64, 64, 3) == grouped_default_config("w8a16", 8, 64, 64, 3)
    with pytest.raises(ValueError, match="weight format"):     # a 4-bit kind's cell names its format
        grouped_config("w4a16", 8, 64, 64, 3)
    for kind, bad, msg in (("w4a16", C(16, 8, 32), "powers of two"), ("w4a16", C(16, 16, 16), "block_k >= 32"),
                           ("fp8", C(16, 64, 256), "block_k <= 128"), ("int8", C(16, 64, 64, 4, 3, 2), "split_k")):
        with pytest.raises(ValueError, match=msg):
            check_config(kind, bad, 256)
    assert C.from_dict(mine.to_dict()) == mine


@pytest.mark.parametrize("kind,weight", [("w4a16", W4Format("int4", 32)), ("w4a16", W4Format("int4", 32, True)),
                                         ("fp4", W4Format("nvfp4", 16)), ("w4a16", W4Format("mxfp4", 32)),
                                         ("w8a16", None), ("int8", None), ("fp8", None)])
def test_tuning_hook_runs_every_kind_under_a_given_config(kind, weight):
    """lowbit.ops.grouped_tune: the closure a tuner times gives [rows, N] finite outputs in the
    requested dtype; time_grouped_case returns a positive median (the interpreter here)."""
    from lowbit.ops.grouped_tune import grouped_case, time_grouped_case
    cfg = C(16, 16, 64, 4, 2)
    run = grouped_case(kind, 3, 24, 64, 5, cfg, DEV, weight=weight, identity=kind == "w8a16")
    out = run()
    assert out.shape == (6, 24) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert time_grouped_case(kind, 3, 24, 64, 5, cfg, DEV, warmup=0, reps=1, weight=weight) > 0


def test_tuning_hook_needs_the_weight_format_of_a_4bit_kind():
    from lowbit.ops.grouped_tune import grouped_case
    with pytest.raises(ValueError, match="weight format"):
        grouped_case("w4a16", 3, 24, 64, 5, C(16, 16, 64, 4, 2), DEV)
    with pytest.raises(ValueError, match="weight format"):
        grouped_case("int8", 3, 24, 64, 5, C(16, 16, 64, 4, 2), DEV, weight=W4Format("int4", 32))


def int4(group: int, symmetric: bool) -> lb.QuantScheme:
    return lb.QuantScheme(format="int4", strategy="group", group_size=group, symmetric=symmetric)


def test_each_weight_format_has_its_own_cell(rng):
    """A table holding cells for int4 g128, int4 g32 with zero points, MXFP4 and NVFP4 at one shape and
    bucket: each format's layers get their own cell's tiles (keys written by hand here), a format
    without a cell (int4 g32 without zero points) the heuristic's, and the W4A16 launcher, given no
    config, asks the table for its own format's key."""
    E, N, K, M = 3, 24, 64, 5
    b = tuning.bucket(M)
    cells = {"w4a16/int4/g128/E3": C(16, 32, 128, 4, 3), "w4a16/int4/g32/zp/E3": C(32, 64, 64, 2, 2),
             "fp4/mxfp4/g32/E3": C(16, 128, 64, 8, 1), "fp4/nvfp4/g16/E3": C(64, 16, 32, 4, 5, 2)}
    table = {("grouped", k, N, K, b): tuning.Cell("grouped", k, N, K, b, "kernel", c.to_dict()) for k, c in cells.items()}
    tuning.reset(tuning.Table(tuning.environment(), table), "test table")
    seen = []
    register_grouped_table(lambda key, n, k, m: seen.append(key))    # records the key, answers None
    try:
        assert GroupedW4A16.tile_config(int4(128, True), E, N, K, M) == cells["w4a16/int4/g128/E3"]
        assert GroupedW4A16.tile_config(int4(32, False), E, N, K, M) == cells["w4a16/int4/g32/zp/E3"]
        assert GroupedFp4.tile_config(get_recipe("mxfp4").weight, E, N, K, M) == cells["fp4/mxfp4/g32/E3"]
        assert GroupedFp4.tile_config(get_recipe("nvfp4").weight, E, N, K, M) == cells["fp4/nvfp4/g16/E3"]
        assert GroupedW4A16.tile_config(int4(32, True), E, N, K, M) == grouped_default_config("w4a16", E, N, K, M)
        assert seen == ["w4a16/int4/g128/E3", "w4a16/int4/g32/zp/E3", "fp4/mxfp4/g32/E3", "fp4/nvfp4/g16/E3",
                        "w4a16/int4/g32/E3"]
        seen.clear()
        T = 3
        idx = top_k_index(rng, T, E, 2, "uniform")
        packed = torch.randint(0, 256, (E, N, K // 2), generator=rng, dtype=torch.uint8)
        zero = torch.randint(-8, 8, (E, N, K // 32), generator=rng, dtype=torch.int32)
        out = grouped_w4a16(torch.randn(T, K, generator=rng).to(DEV), packed.to(DEV),
                            torch.rand(E, N, K // 32, generator=rng).to(DEV), sort_tokens(idx.to(DEV), E),
                            kind="int4", group_size=32, w_zero=zero.to(DEV))
        assert seen == ["w4a16/int4/g32/zp/E3"] and out.shape == (2 * T, N)
    finally:
        register_grouped_table(None)
        tuning.reset()
