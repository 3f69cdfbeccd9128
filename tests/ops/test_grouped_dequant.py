"""The bf16 path of the grouped MoE GEMMs (lowbit.ops.grouped_dequant): the experts' weights
dequantized into one reusable bf16 buffer, bit for bit the exact weights cast to bf16 (the Triton
kernel in the interpreter, skipping experts without rows, and the CPU twin), then torch._grouped_mm
within a gate derived for bf16 operands and fp32 accumulation; and the dispatch that picks it per
bucket of sorted rows (the tuning table's cell, else the grouped heuristic)."""
import pytest
import torch

import lowbit as lb
from lowbit.nn.experts import _stack as stack_experts
from lowbit.ops import scratch, tuning
from lowbit.ops.grouped import grouped_reference, route_fixed, sort_tokens
from lowbit.ops.grouped_dequant import (dequantize_w4, dequantize_w8, grouped_bf16, grouped_bf16_refusal,
                                        grouped_dequant_w4)
from lowbit.ops.grouped_run import run_grouped
from lowbit.ops.kernels.grouped import (GroupedDequantFp4, GroupedDequantW4A16, GroupedDequantW8A16, GroupedFp4,
                                        GroupedInt8, GroupedW4A16, GroupedW8A16, choose_grouped)
from lowbit.ops.triton.dequant import dequantize_packed, dequantize_rows
from lowbit.recipes.presets import get_recipe
from moe_fixtures import top_k_index

U32, U64, U_BF16 = 2.0 ** -24, 2.0 ** -53, 2.0 ** -8
# fp4 e2m1 values by code (sign bit 8), by hand: the oracle of the fp4 weights
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
INT4_ASYM = lb.QuantScheme(format="int4", strategy="group", group_size=32, symmetric=False)
SCHEMES = {"int4": get_recipe("w4a16-g32").weight, "int4_asym": INT4_ASYM, "mxfp4": get_recipe("mxfp4").weight,
           "nvfp4": get_recipe("nvfp4").weight, "int8": get_recipe("w8a16-int8").weight}
W4_KIND = {"int4": "int4", "int4_asym": "int4", "mxfp4": "mxfp4", "nvfp4": "nvfp4"}


@pytest.fixture
def fresh_table():
    tuning.reset(None, "no table (test)")
    scratch.release()
    yield
    tuning.reset()
    scratch.release()


def _experts(rng, name, E, N, K):
    """Per-expert QTensors of random weights (column gains spanning e^+-2) and the grouped kernel's
    operands laid out by its class (what QuantExperts holds)."""
    scheme = SCHEMES[name]
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    qs = [lb.quantize(w[e], scheme) for e in range(E)]
    kernel = choose_grouped(scheme, None, N, K).kernel
    assert kernel.dequant is not None, kernel
    return scheme, qs, kernel, kernel.prepare(scheme, stack_experts(qs), None)


def _exact_bf16(q: lb.QTensor, name: str) -> torch.Tensor:
    """Expert q's weight as the bf16 path must hold it, from torch casts and the e2m1 table:
    int4 / int8: (code - z) * s is exact in float64, rounded once to float32 (QTensor.dequantize's
    value) and once to bf16. fp4: e2m1 x e8m0 / e4m3 has at most 6 significant bits: exact in bf16
    (checked), NVFP4 without its tensor scale (applied to the GEMM's output)."""
    G = q.scheme.group_size or q.codes.shape[1]
    if name.startswith("int"):
        v = q.codes.double()
        if q.zero_point is not None:
            v = v - q.zero_point.double().repeat_interleave(G, dim=1)
        v = v * q.scale.double().reshape(v.shape[0], -1).repeat_interleave(G, dim=1)
        out = v.float().bfloat16()
        assert torch.equal(out, q.dequantize(torch.float32).bfloat16())
        return out
    sdt = torch.float8_e8m0fnu if name == "mxfp4" else torch.float8_e4m3fn
    v = E2M1[q.codes.long()] * q.scale_codes.view(sdt).double().repeat_interleave(G, dim=1)
    assert torch.equal(v.bfloat16().double(), v)         # exact in bf16
    return v.bfloat16()


def _dequantize_triton(kernel, name, ops, out, offsets):
    if name == "int8":
        return dequantize_rows(ops["w"], ops["s"].reshape(-1), out, offsets)
    group = SCHEMES[name].group_size
    return dequantize_packed(ops["w"], ops["s"], out, wfmt={"int4": 0, "mxfp4": 2, "nvfp4": 3}[W4_KIND[name]],
                             group=group, zero=ops.get("z"), offsets=offsets)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_scratch_weights_are_the_exact_weights_in_bf16(name, rng, interpreter):
    """The Triton kernel (interpreter; with the routing's offsets only the experts that have rows are
    written, the others keep what the buffer held) and the CPU twin write every weight bit for bit as
    _exact_bf16. N = 20: 16-row programs straddle two experts."""
    E, N, K = 5, 20, 96
    scheme, qs, kernel, ops = _experts(rng, name, E, N, K)
    want = torch.stack([_exact_bf16(q, name) for q in qs])
    idx = top_k_index(rng, 9, E, 2, "sparse")                 # two experts used, three empty
    offsets = sort_tokens(idx, E).offsets
    used = (offsets[1:] > offsets[:-1]).tolist()
    out = torch.full((E, N, K), float("nan"), dtype=torch.bfloat16)
    _dequantize_triton(kernel, name, ops, out, offsets)
    for e in range(E):
        assert torch.equal(out[e], want[e]) if used[e] else bool(out[e].isnan().all()), (e, used[e])
    assert torch.equal(_dequantize_triton(kernel, name, ops, torch.empty_like(out), None), want)
    twin = torch.empty_like(out)
    if name == "int8":
        dequantize_w8(ops["w"], ops["s"], twin)
    else:
        dequantize_w4(ops["w"], ops["s"], twin, kind=W4_KIND[name], group=scheme.group_size, zero=ops.get("z"))
    assert torch.equal(twin, want)


def _gate(xd, wd, bias, rho, K):
    """|out - ref| bound of the bf16 path's fp32 output, per [rows, N], for x [rows, K] (bf16 values,
    exact in float64), the exact weights wd [N, K] (float64; NVFP4's include the tensor scale) and
    the path's: each weight w_hat with |w_hat * g - w| <= rho |w| (int4 / int8: the float32 product
    and the bf16 rounding, rho = 2^-8 + 2 * 2^-24; MXFP4 0; NVFP4 2^-24, QTensor's effective scale
    float32(e4m3 * g)). With T = sum_k |x||w| and A = (1 + rho) T >= sum_k |x||w_hat * g|:
      fp32 accumulation of K exact products (bf16 x bf16 fits float32)   gamma_K(u32) A
      the GEMM's output rounded to bf16                                   u_bf16 (1 + gamma) A
      * g and + bias in float32 (2 roundings of values <= Z + |b|)        u32 (2 Z + |b|),
                                                                          Z = A (1 + gamma)(1 + u_bf16)(1 + u32)
      the float64 reference's own roundings                               4 u64 (T + |b|)"""
    T = xd.abs() @ wd.abs().T
    A = (1 + rho) * T
    gam = K * U32 / (1 - K * U32)
    Z = A * (1 + gam) * (1 + U_BF16) * (1 + U32)
    b = 0 if bias is None else bias.double().abs()
    return rho * T + gam * A + U_BF16 * (1 + gam) * A + U32 * (2 * Z + b) + 4 * U64 * (T + b)


RHO = {"int4": U_BF16 + 2 * U32, "int4_asym": U_BF16 + 2 * U32, "int8": U_BF16 + 2 * U32, "mxfp4": 0.0,
       "nvfp4": U32}


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("kind", ["hot", "sparse", "dropped"])
def test_bf16_path_within_its_gate(name, kind, rng, fresh_table):
    """run_grouped with a "dequant" cell for the bucket (17-64 here, where the heuristic would run the
    kernel: the table wins) runs the bf16 path through the scratch buffer: each kept row within _gate
    of the float64 grouped reference, the dropped slots' rows (past offsets[E]) zero."""
    E, N, K, T = 5, 36, 96, 11
    scheme, qs, kernel, ops = _experts(rng, name, E, N, K)
    x = (torch.randn(T, K, generator=rng) * torch.exp(torch.randn(T, 1, generator=rng))).bfloat16()
    bias = torch.randn(E, N, generator=rng)
    idx = top_k_index(rng, T, E, 2, kind)
    routing, compact = route_fixed(idx, E), sort_tokens(idx, E)
    key = ("grouped", kernel.table_key(scheme, E), N, K, tuning.bucket(routing.rows))
    tuning.reset(tuning.Table(tuning.environment(), {key: tuning.Cell(*key, "dequant")}), "test table")
    assert kernel.for_rows(scheme, E, N, K, routing.rows, torch.bfloat16) is kernel.dequant
    out = run_grouped(kernel, ops, scheme, None, x, routing, bias=bias)
    assert list(scratch._BUFFERS) == [((E, N, K), torch.bfloat16, "cpu")]
    M = compact.rows
    assert out.dtype == torch.float32 and not out[M:].any()
    ref = grouped_reference(x[compact.token].double(), compact.offsets, qs, bias.double())
    expert = compact.expert_of_rows()
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().reshape(-1)
        wd = qs[e].dequantize(torch.float64)
        gate = _gate(x[compact.token[rows]].double(), wd, bias[e], RHO[name], K)
        err = (out[rows].double() - ref[rows]).abs()
        assert (err <= gate).all(), (e, float((err / gate).max()))


def test_fp4_activations_on_the_bf16_path(rng, fresh_table):
    """grouped_fp4's bf16 path: NVFP4 activations quantized and dequantized exactly (bf16 holds them),
    the weights through the buffer, the two tensor scales' product on the output: against the float64
    reference of the same activation codes, within _gate with both effective scales' float32
    rounding and the product's (rho = 3 u32)."""
    r = get_recipe("nvfp4")
    E, N, K, T = 3, 24, 64, 9
    w = torch.randn(E, N, K, generator=rng)
    qs = [lb.quantize(w[e], r.weight) for e in range(E)]
    ops = GroupedFp4.prepare(r.weight, stack_experts(qs), r.act)
    x = torch.randn(T, K, generator=rng).bfloat16()
    idx = top_k_index(rng, T, E, 2, "uniform")
    routing, compact = route_fixed(idx, E), sort_tokens(idx, E)
    key = ("grouped", "fp4/nvfp4/g16/E3", N, K, tuning.bucket(routing.rows))
    tuning.reset(tuning.Table(tuning.environment(), {key: tuning.Cell(*key, "dequant")}), "test table")
    assert GroupedFp4.for_rows(r.weight, E, N, K, routing.rows, torch.bfloat16) is GroupedDequantFp4
    out = run_grouped(GroupedFp4, ops, r.weight, r.act, x, routing)
    xq = lb.quantize(x.float(), r.act)
    xd = xq.dequantize(torch.float64)[compact.token]
    ref = grouped_reference(xd, compact.offsets, qs)
    expert = compact.expert_of_rows()
    for e in expert.unique().tolist():
        rows = (expert == e).nonzero().reshape(-1)
        gate = _gate(xd[rows], qs[e].dequantize(torch.float64), None, 3 * U32, K)
        assert ((out[rows].double() - ref[rows]).abs() <= gate).all()


def test_grouped_heuristic_and_for_rows(fresh_table):
    """Without a cell: the weight-only kinds' bf16 path from 65 sorted rows (the prefill buckets), the
    W8A8 kinds' kernels everywhere; the bf16 path only for bf16 activations with K a multiple of 8."""
    for key in ("w4a16/int4/g128/E8", "fp4/mxfp4/g32/E8", "w8a16/E8"):
        assert [tuning.heuristic(key, m, "grouped") for m in (1, 16, 64, 65, 4096)] == ["kernel"] * 3 + ["dequant"] * 2
    for key in ("int8/E8", "fp8/E8", "mxfp8/E8"):
        assert {tuning.heuristic(key, m, "grouped") for m in (1, 65, 4096)} == {"kernel"}
    w4, w4g32, w8 = (get_recipe(r).weight for r in ("w4a16", "w4a16-g32", "w8a16-int8"))
    i8 = get_recipe("w8a8-int8").weight
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 64, torch.bfloat16) is GroupedW4A16
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 65, torch.bfloat16) is GroupedDequantW4A16
    assert GroupedW8A16.for_rows(w8, 8, 64, 128, 4096, torch.bfloat16) is GroupedDequantW8A16
    for dtype in (torch.float16, torch.float32):
        assert GroupedW4A16.for_rows(w4, 8, 64, 128, 4096, dtype) is GroupedW4A16
    assert GroupedInt8.for_rows(i8, 8, 64, 128, 4096, torch.bfloat16) is GroupedInt8
    # a measured "kernel" cell at a prefill bucket wins over the heuristic, for its weight format only
    key = ("grouped", "w4a16/int4/g128/E8", 64, 128, "513+")
    tuning.reset(tuning.Table(tuning.environment(), {key: tuning.Cell(*key, "kernel")}), "test table")
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 4096, torch.bfloat16) is GroupedW4A16
    assert GroupedW4A16.for_rows(w4g32, 8, 64, 128, 4096, torch.bfloat16) is GroupedDequantW4A16
    assert GroupedW4A16.for_rows(w4, 8, 64, 128, 200, torch.bfloat16) is GroupedDequantW4A16


def test_bf16_path_refuses_what_it_cannot_run(rng):
    assert "bfloat16" in grouped_bf16_refusal(torch.float16, 128)
    assert "multiple of 8" in grouped_bf16_refusal(torch.bfloat16, 36)
    assert "sm_90 / sm_100" in grouped_bf16_refusal(torch.bfloat16, 128, (8, 0))
    assert grouped_bf16_refusal(torch.bfloat16, 128, (9, 0)) is None
    E, N, K = 3, 16, 64
    routing = route_fixed(top_k_index(rng, 5, E, 2, "uniform"), E)
    w = torch.zeros(E, N, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        grouped_bf16(torch.zeros(5, K, dtype=torch.float16), w, routing)
    with pytest.raises(ValueError, match=r"x must be \[rows, K = 64\]"):
        grouped_bf16(torch.zeros(5, 32, dtype=torch.bfloat16), w, routing)
    with pytest.raises(ValueError, match="multiple of 8"):
        grouped_bf16(torch.zeros(5, 36, dtype=torch.bfloat16), torch.zeros(E, N, 36, dtype=torch.bfloat16), routing)
    packed = torch.zeros(E, N, K // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size=None"):
        grouped_dequant_w4(torch.zeros(5, K, dtype=torch.bfloat16), packed, torch.ones(E, N, 2), routing)


def test_doctor_and_explain_show_the_grouped_path_per_bucket(fresh_table):
    """lowbit.ops.kernels.explain names the class each bucket of sorted rows runs (bf16 activations),
    and `lowbit doctor`'s heuristic rows list the grouped kinds."""
    from lowbit.entrypoints import doctor
    from lowbit.ops.kernels import explain
    w4 = explain(get_recipe("w4a16").weight, None, N=256, K=256, E=8)["grouped"]
    assert w4["kernel"] == "grouped_w4a16"
    assert w4["rows"] == {"1": "grouped_w4a16", "2-16": "grouped_w4a16", "17-64": "grouped_w4a16",
                          "65-512": "grouped_dequant_w4a16", "513+": "grouped_dequant_w4a16"}
    r = get_recipe("w8a8-int8")
    assert set(explain(r.weight, r.act, N=256, K=256)["grouped"]["rows"].values()) == {"grouped_int8"}
    paths = doctor.tuning_report()["paths"]
    w4 = paths["experts w4a16/int4/g128/E8"]
    assert w4["513+"] == "dequant" and w4["1"] == "kernel"
    assert set(paths["experts int8/E8"].values()) == {"kernel"}

