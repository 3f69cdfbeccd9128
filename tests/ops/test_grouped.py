"""Grouped MoE GEMM kernels (Triton; the CPU interpreter here) against the float64 grouped
reference: int8 accumulators bit-exact, outputs within check_grouped_linear's derived gate, at
odd expert counts and skewed routings (empty experts, one hot expert, dropped slots)."""
import pytest
import torch

import lowbit as lb
from lowbit.ops.grouped import grouped_reference, sort_tokens, take_rows
from lowbit.ops.triton.grouped import grouped_int8, grouped_w4a16
from lowbit.verify.grouped import check_grouped_linear
from moe_fixtures import top_k_index

# the kernels run on the GPU where there is one (Triton's interpreter on the CPU otherwise)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INT8_W = lb.QuantScheme(format="int8", strategy="channel")
INT8_X = lb.QuantScheme(format="int8", strategy="token", dynamic=True)


def _routing(rng, T, E, k, kind):
    return top_k_index(rng, T, E, k, kind)


CASES = [(5, "uniform"), (7, "hot"), (5, "sparse"), (3, "dropped")]


@pytest.mark.parametrize("E,kind", CASES)
def test_grouped_int8_accumulator_bit_exact_and_output_within_gate(E, kind, rng):
    T, K, N, k = 11, 96, 40, 2
    x = torch.randn(T, K, generator=rng) * torch.exp(torch.randn(T, 1, generator=rng))
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    bias = torch.randn(E, N, generator=rng)
    idx = _routing(rng, T, E, k, kind)
    routing, on_dev = sort_tokens(idx, E), sort_tokens(idx.to(DEV), E)
    xq = lb.quantize(x, INT8_X)
    wq = [lb.quantize(w[e], INT8_W) for e in range(E)]
    codes = torch.stack([q.codes for q in wq])
    scales = torch.stack([q.scale for q in wq])
    args = [t.to(DEV) for t in (xq.codes, xq.scale, codes, scales)]
    raw = grouped_int8(*args, on_dev, raw=True).cpu()
    rows_x = xq.codes[routing.token].to(torch.int64)
    e_of = routing.expert_of_rows()
    want = torch.einsum("mk,mnk->mn", rows_x, codes[e_of].to(torch.int64))      # exact integers
    assert torch.equal(raw.to(torch.int64), want)
    out = grouped_int8(*args, on_dev, bias=bias.to(DEV)).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, x_scheme=INT8_X, w_scheme=INT8_W, bias=bias)
    assert v.passed, v.report()
    ref = grouped_reference(take_rows(xq, routing.token), routing.offsets, wq, bias)
    assert torch.isfinite(ref).all() and not torch.equal(out.double(), torch.zeros_like(ref))


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("E,kind", CASES)
def test_grouped_w4a16_within_gate(E, kind, group, rng):
    T, K, N, k = 9, 128, 24, 2
    scheme = lb.QuantScheme(format="int4", strategy="group", group_size=group)
    x = torch.randn(T, K, generator=rng)
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    idx = _routing(rng, T, E, k, kind)
    routing = sort_tokens(idx, E)
    wq = [lb.quantize(w[e], scheme) for e in range(E)]
    packed = torch.stack([lb.pack_int4(q.codes) for q in wq])
    scales = torch.stack([q.scale for q in wq])
    out = grouped_w4a16(x.to(DEV), packed.to(DEV), scales.to(DEV), sort_tokens(idx.to(DEV), E), group_size=group).cpu()
    v = check_grouped_linear(out, x[routing.token], w, routing.offsets, w_scheme=scheme, accumulator="fp32")
    assert v.passed, v.report()


def test_grouped_kernels_refuse_bad_input(rng):
    E, T, K, N = 3, 4, 64, 16
    xq = lb.quantize(torch.randn(T, K, generator=rng), INT8_X)
    wc = torch.zeros(E, N, K, dtype=torch.int8)
    ws = torch.ones(E, N)
    routing = sort_tokens(torch.zeros(T, 2, dtype=torch.long) + torch.tensor([0, 1]), E)
    with pytest.raises(ValueError, match="routing has 3 experts, the weights 4"):
        grouped_int8(xq.codes, xq.scale, torch.zeros(4, N, K, dtype=torch.int8), torch.ones(4, N), routing)
    with pytest.raises(TypeError, match="int8"):
        grouped_int8(xq.codes.float(), xq.scale, wc, ws, routing)
    with pytest.raises(ValueError, match="no rows"):
        grouped_int8(xq.codes, xq.scale, wc, ws, sort_tokens(torch.full((T, 1), E), E))
    with pytest.raises(ValueError, match="multiple of group_size"):
        grouped_w4a16(torch.randn(T, 48), torch.zeros(E, N, 24, dtype=torch.uint8), torch.ones(E, N, 1), routing,
                      group_size=32)
    with pytest.raises(ValueError, match="0 tokens"):
        sort_tokens(torch.zeros(0, 2, dtype=torch.long), E)
