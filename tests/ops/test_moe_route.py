"""An MoE call's routing and combine (lowbit.ops.grouped.route_fixed / combine and their one-launch
Triton twins in lowbit.ops.triton.moe_route): the routing against an independent stable sort in Python,
the twins bit for bit against the torch versions, and combine bit for bit against a float32 loop in
numpy (IEEE single products and sums, no fused multiply-add) with ml_dtypes' bfloat16 rounding."""
import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.ops.grouped import combine, route_fixed
from lowbit.ops.triton.moe_route import ROUTE_MAX_ROWS, combine_small, route_small
from moe_fixtures import top_k_index

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(8, 1, 2), (5, 7, 2), (3, 40, 3), (1, 5, 1), (128, 16, 8), (256, 16, 8), (60, 9, 4)]   # E, T, top_k


def _kinds(E):
    return ["uniform", "dropped"] + (["hot", "sparse"] if E >= 2 else [])


@pytest.mark.parametrize("E,T,k", SHAPES)
def test_route_small_is_route_fixed_and_a_stable_sort(E, T, k, rng):
    for kind in _kinds(E):
        if kind == "sparse" and k > 2:
            continue
        idx = top_k_index(rng, T, E, k, kind)
        want = route_fixed(idx, E)
        got = route_small(idx.to(DEV), E)
        for f, g in zip(("token", "slot", "offsets", "inverse"), got):
            assert torch.equal(g.cpu(), getattr(want, f)), (kind, f)
        flat = idx.reshape(-1).tolist()
        order = sorted(range(len(flat)), key=lambda i: (flat[i], i))     # Python's sort is stable
        assert want.token.tolist() == [i // k for i in order] and want.slot.tolist() == [i % k for i in order]
        assert want.offsets.tolist() == [sum(1 for v in flat if v < e) for e in range(E + 1)]
        assert [order[r] for r in want.inverse.tolist()] == list(range(len(flat)))


def test_route_small_refuses_more_rows_than_one_program_holds(rng):
    idx = top_k_index(rng, ROUTE_MAX_ROWS // 2 + 1, 4, 2, "uniform")
    with pytest.raises(ValueError, match="route_fixed"):
        route_small(idx, 4)


def _numpy_combine(h: torch.Tensor, w: torch.Tensor, inverse: torch.Tensor, dtype) -> np.ndarray:
    T, k = w.shape
    hn, wn, inv = h.float().numpy(), w.float().numpy(), inverse.reshape(T, k).numpy()
    acc = np.zeros((T, h.shape[1]), dtype=np.float32)
    for s in range(k):
        acc = acc + wn[:, s:s + 1] * hn[inv[:, s]]          # float32 product, then float32 sum
    return acc.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == torch.bfloat16 else acc


@pytest.mark.parametrize("E,T,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_a_float32_loop_and_its_twin(E, T, k, dtype, rng):
    H = 24 + int(torch.randint(0, 40, (1,), generator=rng))          # not a multiple of the kernel's block
    idx = top_k_index(rng, T, E, k, "dropped")
    r = route_fixed(idx, E)
    h = torch.randn(T * k, H, generator=rng) * torch.exp(torch.randn(T * k, 1, generator=rng))
    h[int(r.offsets[-1]):] = 0                                        # rows no expert owns (the kernels' zeros)
    w = torch.softmax(torch.randn(T, k, generator=rng), dim=-1)
    want = _numpy_combine(h, w, r.inverse, dtype)
    got = combine(h, w, r, dtype)
    assert got.dtype == dtype and np.array_equal(got.float().numpy(), want)
    twin = combine_small(h.to(DEV), w.to(DEV), route_small(idx.to(DEV), E)[3], dtype).cpu()
    assert torch.equal(twin, got)


def test_combine_needs_the_inverse(rng):
    r = route_fixed(top_k_index(rng, 3, 4, 2, "uniform"), 4)
    r = type(r)(r.token, r.slot, r.offsets, r.num_tokens)
    with pytest.raises(ValueError, match="inverse"):
        combine(torch.zeros(6, 8), torch.ones(3, 2), r, torch.float32)
