"""The grouped MoE kernels beyond int8 / int4 (fp8 W8A8, weight-only int8 / int4 with zero points /
MXFP4 / NVFP4, MXFP8 through SFA / SFB words) against the float64 grouped reference
(check_grouped_linear's derived gate), at odd expert counts, K not a tile multiple and skewed
routings; the fixed-shape routing and tile schedule (no host synchronisation)."""
import pytest
import torch
import triton
import triton.language as tl

import lowbit as lb
from lowbit.ops.grouped import route_fixed, scale_words_int32, sfa_words, sfb_words, sort_tokens
from lowbit.ops.kernels.base import fp8_dot_accumulator
from lowbit.ops.triton.grouped import grouped_fp8, grouped_int8, grouped_w4a16, grouped_w8a16
from lowbit.ops.triton.grouped_mx import grouped_mxfp8, sfa_for_tokens, sfb_for_experts
from lowbit.ops.triton.grouped_schedule import max_tiles, schedule_args, tile_rows
from lowbit.packing import pack_fp4, pack_int4
from lowbit.recipes.presets import get_recipe
from lowbit.verify.grouped import check_grouped_linear
from moe_fixtures import top_k_index

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the kernels on the GPU where there is one
CASES = [(5, "uniform"), (3, "hot"), (5, "sparse"), (3, "dropped")]


def _data(rng, T, E, N, K):
    x = torch.randn(T, K, generator=rng) * torch.exp(torch.randn(T, 1, generator=rng))
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    return x, w


def _stack(qs, field):
    return torch.stack([getattr(q, field) for q in qs])


def _dev(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


@pytest.mark.parametrize("E,kind", CASES)
def test_grouped_fp8_within_gate(E, kind, rng):
    r = get_recipe("w8a8-fp8")
    T, N, K = 11, 40, 96
    x, w = _data(rng, T, E, N, K)
    bias = torch.randn(E, N, generator=rng)
    idx = top_k_index(rng, T, E, 2, kind)
    routing = sort_tokens(idx, E)
    xq, wq = lb.quantize(x, r.act), [lb.quantize(w[e], r.weight) for e in range(E)]
    out = grouped_fp8(*_dev(xq.codes, xq.scale, _stack(wq, "codes"), _stack(wq, "scale")), sort_tokens(idx.to(DEV), E),
                      bias=bias.to(DEV)).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, x_scheme=r.act, w_scheme=r.weight, bias=bias,
                             accumulator=fp8_dot_accumulator(DEV))
    assert v.passed, v.report()


@pytest.mark.parametrize("K", [96, 256])          # one (padded) word group; two word groups
@pytest.mark.parametrize("E,kind", CASES[:2])
def test_grouped_mxfp8_within_gate(E, kind, K, rng):
    mx = get_recipe("mxfp8").weight
    T, N = 9, 24
    x, w = _data(rng, T, E, N, K)
    idx = top_k_index(rng, T, E, 2, kind)
    routing = sort_tokens(idx, E)
    xq, wq = lb.quantize(x, mx), [lb.quantize(w[e], mx) for e in range(E)]
    dr = sort_tokens(idx.to(DEV), E)
    sfa = sfa_for_tokens(xq.scale_codes.reshape(T, -1).to(DEV), dr)
    out = grouped_mxfp8(*_dev(xq.codes), sfa, *_dev(_stack(wq, "codes"), sfb_for_experts(_stack(wq, "scale_codes"))),
                        dr).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, x_scheme=mx, w_scheme=mx)
    assert v.passed, v.report()


@pytest.mark.parametrize("G", [3, 8, 10])
def test_int32_scale_words_are_the_packed_words(G, rng):
    """The kernel's int32 words (bytes moved, no uint32 arithmetic) equal lowbit.packing's
    group-major uint32 words bit for bit: SFA over rows, SFB over (E, N); G % 4 != 0 padded."""
    a = torch.randint(0, 256, (13, G), generator=rng, dtype=torch.uint8)
    b = torch.randint(0, 256, (3, 5, G), generator=rng, dtype=torch.uint8)
    assert torch.equal(scale_words_int32(a), sfa_words(a).view(torch.int32))
    assert torch.equal(sfb_for_experts(b), sfb_words(b).view(torch.int32))


def test_mxfp8_kernel_reads_the_seed_layouts(rng):
    """The kernel reads SFA[g * M_total + m] and SFB[g * E * N + e * N + n]. Words permuted so that
    this read fetches what a wrong index would fetch from the right words (row-major SFB,
    SFA over each expert's own M) give outputs that check_grouped_linear names by that very
    layout bug. K = 256: two word groups."""
    mx = get_recipe("mxfp8").weight
    T, E, N, K = 8, 5, 16, 256
    x, w = _data(rng, T, E, N, K)
    idx = top_k_index(rng, T, E, 2, "uniform")
    routing = sort_tokens(idx, E)
    xq, wq = lb.quantize(x, mx), [lb.quantize(w[e], mx) for e in range(E)]
    codes_w, sc_w = _stack(wq, "codes"), _stack(wq, "scale_codes")
    good_a = sfa_for_tokens(xq.scale_codes.reshape(T, -1), routing).view(torch.uint32)
    good_b = sfb_words(sc_w)
    M, G4 = routing.rows, 2
    row_major_b = good_b.reshape(E * N, G4).t().contiguous().reshape(-1)   # read at g*EN + r -> word r*G4 + g
    m = torch.arange(M)
    m_e = routing.counts()[routing.expert_of_rows()]
    local_a = torch.zeros(G4 * M, dtype=torch.int64)
    for g in range(G4):                                                    # read at g*M + m -> word g*M_e + m
        src = g * m_e + m
        ok = src < G4 * M
        local_a[g * M + m[ok]] = good_a.to(torch.int64)[src[ok]]
    for name, sfa, sfb in (("sfb_row_major", good_a, row_major_b), ("sfa_local_m", local_a.to(torch.uint32), good_b)):
        out = grouped_mxfp8(*_dev(xq.codes, sfa, codes_w, sfb), sort_tokens(idx.to(DEV), E)).cpu()
        v = check_grouped_linear(out, x[routing.token], w, routing.offsets, x_scheme=mx, w_scheme=mx)
        assert not v.passed and v.causes and v.causes[0][0] == name, v.report()


@pytest.mark.parametrize("wkind", ["mxfp4", "nvfp4", "int4_asym"])
@pytest.mark.parametrize("E,kind", CASES[1:3])
def test_grouped_w4a16_fp4_and_zero_points_within_gate(wkind, E, kind, rng):
    T, N, K = 9, 24, 96
    scheme = (lb.QuantScheme(format="int4", strategy="group", group_size=32, symmetric=False)
              if wkind == "int4_asym" else get_recipe(wkind).weight)
    x, w = _data(rng, T, E, N, K)
    bias = torch.randn(E, N, generator=rng)
    idx = top_k_index(rng, T, E, 2, kind)
    routing = sort_tokens(idx, E)
    wq = [lb.quantize(w[e], scheme) for e in range(E)]
    if wkind == "int4_asym":
        args = dict(kind="int4", group_size=32, w_zero=_stack(wq, "zero_point").to(DEV))
        packed, scale = torch.stack([pack_int4(q.codes) for q in wq]), _stack(wq, "scale")
    else:
        g = None if wq[0].global_scale is None else torch.stack([q.global_scale.reshape(()) for q in wq])
        args = dict(kind=wkind, w_global=None if g is None else g.to(DEV))
        packed, scale = torch.stack([pack_fp4(q.codes) for q in wq]), _stack(wq, "scale_codes")
    out = grouped_w4a16(*_dev(x, packed, scale), sort_tokens(idx.to(DEV), E), bias=bias.to(DEV), **args).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, w_scheme=scheme, bias=bias, accumulator="fp32")
    assert v.passed, v.report()


@pytest.mark.parametrize("E,kind", CASES[2:])
def test_grouped_w8a16_within_gate(E, kind, rng):
    scheme = get_recipe("w8a16-int8").weight
    T, N, K = 9, 24, 80
    x, w = _data(rng, T, E, N, K)
    idx = top_k_index(rng, T, E, 2, kind)
    routing = sort_tokens(idx, E)
    wq = [lb.quantize(w[e], scheme) for e in range(E)]
    out = grouped_w8a16(*_dev(x, _stack(wq, "codes"), _stack(wq, "scale")), sort_tokens(idx.to(DEV), E)).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, w_scheme=scheme, accumulator="fp32")
    assert v.passed, v.report()


def test_fixed_routing_rows_equal_the_compact_buffer_and_dropped_rows_stay_zero(rng):
    """route_fixed's buffer (capacity T * k, dropped slots last) gives the compact buffer's rows
    bit for bit (int32 accumulators), zeros after them; identity=True reads the sorted buffer."""
    T, E, N, K, k = 13, 5, 24, 64, 3
    idx = top_k_index(rng, T, E, k, "dropped")
    compact, fixed = sort_tokens(idx, E), route_fixed(idx.to(DEV), E)
    assert fixed.rows == T * k and torch.equal(fixed.offsets.cpu(), compact.offsets)
    M = compact.rows
    assert torch.equal(fixed.token.cpu()[:M], compact.token) and torch.equal(fixed.slot.cpu()[:M], compact.slot)
    a = torch.randint(-127, 128, (T, K), generator=rng, dtype=torch.int8)
    wc = torch.randint(-127, 128, (E, N, K), generator=rng, dtype=torch.int8)
    ones = [torch.ones(T), torch.ones(E, N)]
    got = grouped_int8(*_dev(a, ones[0], wc, ones[1]), fixed, raw=True).cpu()
    want = torch.einsum("mk,mnk->mn", a[compact.token].long(), wc[compact.expert_of_rows()].long())
    assert torch.equal(got[:M].long(), want) and not got[M:].any()
    buf = torch.randint(-127, 128, (T * k, K), generator=rng, dtype=torch.int8)
    got = grouped_int8(*_dev(buf, torch.ones(T * k), wc, ones[1]), fixed, raw=True, identity=True).cpu()
    want = torch.einsum("mk,mnk->mn", buf[:M].long(), wc[compact.expert_of_rows()].long())
    assert torch.equal(got[:M].long(), want) and not got[M:].any()


@triton.jit
def _tile_rows_probe(off_ptr, tok_ptr, e_out, rows_out, valid_out, tok_out, kend_out, E, K, BLOCK_M: tl.constexpr,
                     E_PAD: tl.constexpr, IDENTITY: tl.constexpr):
    pid = tl.program_id(0)
    e, rows, valid, tok, k_end = tile_rows(off_ptr, tok_ptr, pid, E, K, BLOCK_M, E_PAD, IDENTITY)
    at = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(e_out + pid, e)
    tl.store(kend_out + pid, k_end)
    tl.store(rows_out + at, rows)
    tl.store(valid_out + at, valid.to(tl.int32))
    tl.store(tok_out + at, tok)


def _schedule_oracle(offsets: list[int], block_m: int, tiles: int, E: int) -> list[tuple[int, int]]:
    """Per tile: (expert, first row) by walking the experts in order, or (E, 0) past the last live tile."""
    plan = [(e, r0) for e in range(E) for r0 in range(offsets[e], offsets[e + 1], block_m)]
    return plan + [(E, 0)] * (tiles - len(plan))


@pytest.mark.parametrize("E,block_m", [(3, 4), (5, 16), (7, 8), (1, 16), (130, 16)])
@pytest.mark.parametrize("kind", ["uniform", "hot", "dropped"])
def test_tile_rows_cover_every_row_once_within_the_static_grid(E, block_m, kind, rng):
    """The kernels' in-program schedule (grouped_schedule.tile_rows) against a walk over the experts:
    each tile's expert, rows, validity, tokens and K extent; every kept row in exactly one tile; no
    row of a dropped slot; tiles past the last live one run no K step."""
    T, k, K = int(torch.randint(1, 40, (1,), generator=rng)), min(2, E), 96
    if kind == "hot" and E < 2:
        kind = "uniform"
    r = route_fixed(top_k_index(rng, T, E, k, kind), E)
    off = r.offsets.tolist()
    for identity in (False, True):
        o, t, tiles, e_pad = schedule_args(r, block_m, identity)
        assert tiles == max_tiles(T * k, E, block_m) and e_pad >= E
        outs = [torch.empty(tiles, dtype=torch.int64), torch.empty(tiles * block_m, dtype=torch.int32),
                torch.empty(tiles * block_m, dtype=torch.int32), torch.empty(tiles * block_m, dtype=torch.int64),
                torch.empty(tiles, dtype=torch.int32)]
        outs = _dev(*outs)
        _tile_rows_probe[(tiles,)](*_dev(o, t), *outs, E, K, BLOCK_M=block_m, E_PAD=e_pad, IDENTITY=identity)
        e_t, rows, valid, tok, k_end = (x.cpu() for x in outs)
        rows, valid, tok = rows.reshape(tiles, block_m), valid.reshape(tiles, block_m).bool(), tok.reshape(tiles, -1)
        seen = []
        for i, (e, r0) in enumerate(_schedule_oracle(off, block_m, tiles, E)):
            live = e < E
            assert int(e_t[i]) == min(e, E - 1) and int(k_end[i]) == (K if live else 0)
            if not live:
                assert not valid[i].any()
                continue
            want = [r0 + j < off[e + 1] for j in range(block_m)]
            assert valid[i].tolist() == want and rows[i, 0] == r0
            assert rows[i].tolist() == list(range(r0, r0 + block_m))
            mine = rows[i][valid[i]].long()
            assert torch.equal(tok[i][valid[i]], mine if identity else r.token[mine])
            seen += mine.tolist()
        assert seen == list(range(off[-1]))          # every kept row once, in order


def test_routing_has_no_data_dependent_shapes(rng):
    """torch.compile(fullgraph=True) refuses a graph break: .item(), .tolist(), nonzero or a shape
    read from data would raise here. The shapes depend only on (T, k, E)."""
    E = 5

    def route(idx):
        r = route_fixed(idx, E)
        return r.token, r.slot, r.offsets
    compiled = torch.compile(route, fullgraph=True, backend="eager", dynamic=False)
    for kind in ("uniform", "dropped"):
        idx = top_k_index(rng, 7, E, 2, kind)
        got, want = compiled(idx), route(idx)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert [tuple(t.shape) for t in got] == [(14,), (14,), (E + 1,)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation is a CUDA notion")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-int8-tensor", "w8a8-fp8", "w8a16-int8", "w4a16-g32", "mxfp8",
                                    "mxfp4", "nvfp4"])
@pytest.mark.parametrize("T", [7, 40])      # 40 tokens: 80 sorted rows, the weight-only kinds' bf16 path
def test_quant_experts_kernel_forward_has_no_host_sync(recipe, T, rng):
    from lowbit.nn.experts import QuantExperts
    E, H, I, k = 5, 64, 96, 2
    gu = torch.randn(E, 2 * I, H, generator=rng)
    dn = torch.randn(E, H, I, generator=rng)
    module = torch.nn.Module()
    module.gate_up_proj, module.down_proj = torch.nn.Parameter(gu), torch.nn.Parameter(dn)
    module.act_fn = torch.nn.SiLU()
    r = get_recipe(recipe)
    q = QuantExperts.from_module(module, r.weight, r.act).cuda()
    x = torch.randn(T, H, generator=rng).cuda().to(torch.bfloat16)
    idx = top_k_index(rng, T, E, k, "dropped").cuda()
    wts = torch.rand(T, k, generator=rng).cuda()
    q(x, idx, wts)                                      # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = q(x, idx, wts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert q.last_path == f"{_path(q, T * k)}:{q.kernel}" and out.shape == (T, H) and torch.isfinite(out.float()).all()


def _path(q, rows: int) -> str:
    """The path of `rows` sorted rows without a grouped table cell: the bf16 path of the weight-only
    kinds from 65 rows on a GPU whose torch._grouped_mm runs without a host sync (sm_90 / sm_100)."""
    bf16 = q.kernel_class.dequant is not None and torch.cuda.get_device_capability(0)[0] in (9, 10)
    return "dequant" if bf16 and rows >= 65 else "kernel"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8", "w4a16-g32", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("T", [9, 40])      # 40 tokens: 80 sorted rows, the weight-only kinds' bf16 path
def test_quant_experts_kernel_forward_replays_in_a_cuda_graph(recipe, T, rng):
    """Captured once, replayed on new hidden states, routings and weights: the eager call's numbers
    (top-2: each token's float32 sum of two terms is the same in any order)."""
    from lowbit.nn.experts import QuantExperts
    E, H, I, k = 5, 64, 96, 2
    module = torch.nn.Module()
    module.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=rng))
    module.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=rng))
    module.act_fn = torch.nn.SiLU()
    r = get_recipe(recipe)
    q = QuantExperts.from_module(module, r.weight, r.act).cuda()

    def inputs(kind):
        return (torch.randn(T, H, generator=rng).cuda().to(torch.bfloat16), top_k_index(rng, T, E, k, kind).cuda(),
                torch.rand(T, k, generator=rng).cuda())
    static = [t.clone() for t in inputs("uniform")]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q(*static)                                      # compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = q(*static)
    for kind in ("hot", "dropped"):
        new = inputs(kind)
        for s, t in zip(static, new):
            s.copy_(t)
        graph.replay()
        assert torch.equal(out, q(*new)), kind
        assert q.last_path == f"{_path(q, T * k)}:{q.kernel}"
