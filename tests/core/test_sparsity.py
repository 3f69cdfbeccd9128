"""2:4 sparsity: pruning against a per-group Python reference, deterministic ties, exact
compress / decompress round trips, bad input."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowbit as lb
from lowbit.sparsity import compress_2_4, decompress_2_4, is_2_4_sparse, mask_2_4, prune_2_4


def _prune_reference(row):
    """Keep the two largest |v| of each group of 4; lower index first among equal |v|."""
    out = []
    for j in range(0, len(row), 4):
        grp = row[j:j + 4]
        keep = sorted(range(4), key=lambda i: (-abs(grp[i]), i))[:2]
        out += [grp[i] if i in keep else 0.0 for i in range(4)]
    return out


def test_prune_matches_reference(rng, device):
    x = torch.randn(7, 36, generator=rng)
    x[0, :4] = torch.tensor([1.0, -1.0, 1.0, 0.5])  # three-way tie: indices 0 and 1 kept
    x[1, 4:8] = 0.0
    x[2, 8:12] = torch.tensor([0.0, 0.0, 0.0, 3.0])
    p = prune_2_4(x.to(device)).cpu()
    for r in range(7):
        assert p[r].tolist() == _prune_reference(x[r].tolist())
    assert p[0, :4].tolist() == [1.0, -1.0, 0.0, 0.0]
    assert is_2_4_sparse(p) and not is_2_4_sparse(x)
    assert bool((mask_2_4(x).reshape(7, 9, 4).sum(-1) == 2).all())


def test_prune_is_idempotent_and_keeps_dtype(rng):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
        x = (torch.randn(3, 16, generator=rng) * 20).to(dtype)
        p = prune_2_4(x)
        assert p.dtype == dtype and torch.equal(prune_2_4(p), p)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1), st.booleans())
def test_compress_decompress_round_trip(rows, groups, seed, with_zeros):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, 4 * groups), generator=g).float() if with_zeros \
        else torch.randn(rows, 4 * groups, generator=g)
    p = prune_2_4(x)
    vals, idx = compress_2_4(p)
    assert vals.shape == (rows, 2 * groups) and idx.dtype == torch.uint8
    pairs = idx.reshape(rows, groups, 2)
    assert bool((pairs[..., 0] < pairs[..., 1]).all()) and int(idx.max()) <= 3
    assert torch.equal(decompress_2_4(vals, idx), p)
    # the stored values are exactly the non-zeros of p, in order
    nz = p.reshape(rows, groups, 4)
    for r in range(rows):
        for j in range(groups):
            kept = [v for v in nz[r, j].tolist() if v != 0]
            stored = [v for v in vals.reshape(rows, groups, 2)[r, j].tolist() if v != 0]
            assert kept == stored


def test_compress_on_device_and_int_codes(rng, device):
    x = torch.randn(5, 64, generator=rng).to(device)
    qt = lb.quantize(prune_2_4(x), lb.get_preset("int8_channel"))
    vals, idx = compress_2_4(qt.codes)
    assert vals.dtype == torch.int8 and torch.equal(decompress_2_4(vals, idx), qt.codes)


def test_bad_input():
    with pytest.raises(ValueError, match="K = 6.*multiple of 4"):
        prune_2_4(torch.randn(2, 6))
    with pytest.raises(ValueError, match="multiple of 4"):
        compress_2_4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="not 2:4 sparse: 1 group.*first: group \\(0, 1\\).*prune_2_4"):
        compress_2_4(torch.tensor([[1.0, 0, 0, 2, 1, 2, 3, 0]]))
    with pytest.raises(ValueError, match="NaN/Inf"):
        prune_2_4(torch.tensor([[float("nan"), 1.0, 2.0, 3.0]]))
    with pytest.raises(TypeError, match="uint8"):
        prune_2_4(torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="corrupt"):
        decompress_2_4(torch.ones(1, 2), torch.tensor([[2, 1]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="same shape"):
        decompress_2_4(torch.ones(1, 2), torch.tensor([[0, 1, 2, 3]], dtype=torch.uint8))
    with pytest.raises(TypeError, match="indices must be uint8"):
        decompress_2_4(torch.ones(1, 2), torch.tensor([[0, 1]]))
