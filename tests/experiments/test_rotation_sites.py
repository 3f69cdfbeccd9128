"""The on-grid count of lowbit.experiments.rotation_sites against groups built on a 16-level grid."""
import torch

from lowbit.experiments.rotation_sites import on_grid_share


def test_on_grid_share(rng):
    n, groups = 8, 5                           # rows, groups of 32 per row (+ a short tail, ignored)
    q = torch.randint(0, 16, (n, groups * 32), generator=rng).double()
    q[:, 0::32], q[:, 1::32] = 0, 15           # every group spans its grid
    d = torch.rand(n, groups, 1, generator=rng, dtype=torch.float64) + 0.1
    m = torch.randn(n, groups, 1, generator=rng, dtype=torch.float64)
    w = (q.reshape(n, groups, 32) * d + m).reshape(n, -1)
    w = torch.cat([w, torch.randn(n, 7, generator=rng, dtype=torch.float64)], 1)
    assert on_grid_share(w) == 1.0
    w[3, 40] += 0.01 * d[3, 1, 0]             # one element off its grid by 1% of a step: one group of 40
    assert on_grid_share(w) == 1 - 1 / (n * groups)
    rot = w[:, :groups * 32] @ torch.linalg.qr(torch.randn(groups * 32, groups * 32, generator=rng,
                                                           dtype=torch.float64))[0]
    assert on_grid_share(rot) == 0.0
