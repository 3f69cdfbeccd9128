"""Metrics against hand-computed values and numpy formulas."""
import math

import numpy as np
import pytest
import torch

from lowbit.verify import metrics as mt


def test_metrics_against_numpy(rng):
    ref = torch.randn(13, 7, generator=rng, dtype=torch.float64)
    got = ref + 1e-3 * torch.randn(13, 7, generator=rng, dtype=torch.float64)
    r, g = ref.numpy(), got.numpy()
    assert mt.rel_l2(got, ref) == pytest.approx(np.linalg.norm(g - r) / np.linalg.norm(r), rel=1e-12)
    assert mt.rms_err(got, ref) == pytest.approx(np.sqrt(np.mean((g - r) ** 2)), rel=1e-12)
    assert mt.sqnr_db(ref, got) == pytest.approx(10 * np.log10(np.sum(r ** 2) / np.sum((r - g) ** 2)), rel=1e-12)
    err, (i, j) = mt.max_abs_err(got, ref)
    assert (i, j) == np.unravel_index(np.argmax(np.abs(g - r)), r.shape) and err == np.abs(g - r).max()
    assert torch.equal(mt.worst_per_row(got, ref), torch.from_numpy(np.abs(g - r).max(axis=1)))
    assert torch.equal(mt.worst_per_col(got, ref), torch.from_numpy(np.abs(g - r).max(axis=0)))


def test_mismatch_ratio_counts_exactly_and_nan_is_bad():
    ref = torch.zeros(2, 4, dtype=torch.float64)
    got = torch.tensor([[0.0, 0.5, 2.0, float("nan")], [0.0, 0.0, 0.0, 1.0]])
    # atol=1: 2.0 and NaN are bad -> 2 of 8
    assert mt.mismatch_ratio(got, ref, rtol=0.0, atol=1.0) == 2 / 8
    err, where = mt.max_abs_err(got, ref)
    assert math.isinf(err) and where == (0, 3)


def test_code_census_counts_distinct_codes():
    codes = torch.tensor([[0, 1, 1, -1, 0, 0, 2, 2], [5, 6, 7, 8, 9, 10, 11, 12]], dtype=torch.int8)
    c = mt.code_census(codes, 255)
    assert c.used.tolist() == [4, 8] and c.worst == 4 and c.worst_index == (0,)
    assert c.describe() == "4 of 255 codes used (channel 0)"
    g = mt.code_census(codes, 255, group_size=4)
    assert g.used.tolist() == [[3, 2], [4, 4]] and g.worst_index == (0, 1)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="must match"):
        mt.rel_l2(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="group_size"):
        mt.code_census(torch.zeros(2, 6, dtype=torch.int8), 255, group_size=4)
