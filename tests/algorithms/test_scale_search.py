"""MSE-optimal weight scales (lowbit.algorithms.scale_search): against a numpy float64 re-derivation of
the int4 symmetric grid search, never worse than round to nearest per scale for every scheme kind,
and the scales usable by lowbit.quantize and GPTQ as they are."""
import numpy as np
import pytest
import torch

from lowbit.algorithms.gptq.solver import gptq_quantize_weight
from lowbit.recipes.presets import get_recipe
from lowbit.algorithms.scale_search import GRID, search_scales
from lowbit.quantize import Scales, _reduce, quantize


def _weight(rng, n, k):
    """A weight with a few outlier columns (what clipping is for) and a positive Hessian diagonal."""
    w = torch.randn(n, k, generator=rng)
    cols = torch.randint(0, k, (max(1, k // 50),), generator=rng)
    w[:, cols] *= 1 + 6 * torch.rand(len(cols), generator=rng)
    hdiag = torch.rand(k, generator=rng, dtype=torch.float64) ** 2 + 1e-3
    return w, hdiag


def test_int4_group_search_matches_numpy(rng):
    """w4a16's scheme (int4 symmetric, groups of 128, a short last group): the chosen scale of each
    group is one of the candidates amax * p / 7, and its weighted error is the grid's minimum
    computed independently (numpy: float32 scale arithmetic, rint half-even, clamp to +-7)."""
    scheme = get_recipe("w4a16").weight
    n, k = int(torch.randint(3, 12, (1,), generator=rng)), int(torch.randint(130, 400, (1,), generator=rng))
    w, hdiag = _weight(rng, n, k)
    sc = search_scales(w, scheme, hdiag=hdiag)
    g = 128
    kp = -(-k // g) * g
    wn = np.zeros((n, kp), np.float32)
    wn[:, :k] = w.numpy()
    hn = np.zeros(kp)
    hn[:k] = hdiag.numpy()
    got = sc.scale.numpy()
    assert got.shape == (n, kp // g)
    for i in range(n):
        for j in range(kp // g):
            x, h = wn[i, j * g:(j + 1) * g], hn[j * g:(j + 1) * g]
            amax = np.float32(np.abs(x).max())

            def err(s):
                q = np.clip(np.rint(x / np.float32(s)), -7, 7)
                return float(((x.astype(np.float64) - q * np.float64(s)) ** 2 * h).sum())
            cands = [np.float32(np.float32(amax * np.float32(p)) / np.float32(7)) for p in GRID]
            best = min(err(s) for s in cands)
            assert got[i, j] in cands
            # the two sides sum the same 128 float64 terms in different orders: <= 128 eps relative
            assert err(got[i, j]) <= best * (1 + 128 * 2.0 ** -52), (i, j)


@pytest.mark.parametrize("recipe", ["w4a16", "w4a16-asym", "w4a16-g32", "w8a16-int8", "w8a8-fp8", "nvfp4", "mxfp4"])
def test_never_worse_than_round_to_nearest(recipe, rng):
    """Per scale, the searched scales' weighted error is <= round to nearest's (p = 1 is a candidate),
    quantize(scales=...) accepts them with the layout of quantize(pad=True), and grid=(1.0,) is
    round to nearest exactly."""
    scheme = get_recipe(recipe).weight
    n, k = int(torch.randint(2, 9, (1,), generator=rng)), int(torch.randint(40, 300, (1,), generator=rng))
    w, hdiag = _weight(rng, n, k)
    rtn = quantize(w, scheme, pad=True)
    plain = search_scales(w, scheme, hdiag=hdiag, grid=(1.0,))
    for a, b in zip(plain, (rtn.scale, rtn.zero_point, rtn.scale_codes, rtn.global_scale)):
        assert (a is None and b is None) or torch.equal(a, b)
    sc = search_scales(w, scheme, hdiag=hdiag)
    qt = quantize(w, scheme, pad=True, scales=sc)
    assert qt.codes.shape == rtn.codes.shape and qt.scale.shape == rtn.scale.shape
    pad = qt.codes.shape[1] - k
    wp = torch.nn.functional.pad(w.double(), (0, pad))
    hp = torch.nn.functional.pad(hdiag, (0, pad))[None, :]

    def per_scale(q):   # dequantize() has the unpadded shape [n, k]
        return _reduce((wp - torch.nn.functional.pad(q.dequantize(torch.float64), (0, pad))) ** 2 * hp, scheme,
                       torch.sum)
    assert bool((per_scale(qt) <= per_scale(rtn)).all())


def test_gptq_keeps_the_given_scales(rng):
    """GPTQ with fixed (searched) scales stores exactly those scales; loss_rtn is round to nearest's
    loss under them."""
    scheme = get_recipe("w4a16").weight
    n, k = int(torch.randint(3, 10, (1,), generator=rng)), int(torch.randint(130, 300, (1,), generator=rng))
    w, _ = _weight(rng, n, k)
    x = torch.randn(4 * k, k, generator=rng, dtype=torch.float64)
    h = x.T @ x / x.shape[0]
    sc = search_scales(w, scheme, hdiag=torch.diagonal(h))
    res = gptq_quantize_weight(w, h, scheme, damp=0.1, act_order=True, scales=sc)
    assert torch.equal(res.qtensor.scale, sc.scale)
    d = w.double() - quantize(w, scheme, pad=True, scales=sc).dequantize(torch.float64)
    assert res.loss_rtn == float(((d @ h) * d).sum())     # gptq.output_loss's arithmetic: exact



@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_group_with_fixed_scales_is_each_weight_alone(rng, act_order, monkeypatch):
    """gptq_quantize_group with fixed scales for some weights (no dynamic groups for those; weights
    with fixed scales concatenated with each other, scales concatenated along rows): each weight's
    codes and scales are bit for bit its own gptq_quantize_weight with the same scales."""
    from lowbit.algorithms.gptq import hessian, solver as gptq
    monkeypatch.setattr(hessian, "PANEL_ROWS", 4)
    scheme = get_recipe("w4a16-g32").weight
    k = 80
    ws = [_weight(rng, n, k)[0] for n in (7, 5, 6, 9)]
    x = torch.randn(4 * k, k, generator=rng, dtype=torch.float64)
    h = x.T @ x / x.shape[0]
    scs = [search_scales(w, scheme, hdiag=torch.diagonal(h)) for w in ws]
    scs[2] = None                                   # one weight without: dynamic groups, solved alone
    got = gptq.gptq_quantize_group(ws, h, [scheme] * 4, damp=0.1, act_order=act_order, block_size=16, scales=scs)
    for w, sc, qt in zip(ws, scs, got):
        ref = gptq_quantize_weight(w, h, scheme, damp=0.1, act_order=act_order, block_size=16, scales=sc).qtensor
        assert torch.equal(qt.codes, ref.codes) and torch.equal(qt.scale, ref.scale)
        if sc is not None:
            assert torch.equal(qt.scale, sc.scale)

def test_bad_arguments():
    w = torch.randn(4, 64)
    scheme = get_recipe("w4a16-g32").weight
    with pytest.raises(ValueError, match="grid"):
        search_scales(w, scheme, grid=(0.9, 0.8))
    with pytest.raises(ValueError, match="grid"):
        search_scales(w, scheme, grid=(1.0, -0.5))
    with pytest.raises(ValueError, match="hdiag"):
        search_scales(w, scheme, hdiag=torch.ones(63))
    with pytest.raises(ValueError, match="2-D"):
        search_scales(w[0], scheme)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_model_with_mse_scales(method, rng):
    """quantize_model(mse=True) stores, at every layer, codes that lowbit.quantize gives for the
    searched scales (RTN: unweighted search on the layer's weight, so exactly those scales)."""
    from pipelines.test_quantize_model import tiny_llama

    from lowbit.nn import QuantLinear

    from lowbit.pipelines.quantize_model import quantize_model
    model = tiny_llama(rng)
    float_w = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    calib = [torch.randint(0, 97, (1, 48), generator=rng) for _ in range(3)]
    quantize_model(model, "w4a16-g32", method=method, calib=calib if method == "gptq" else None, mse=True)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14
    scheme = get_recipe("w4a16-g32").weight
    for n, ql in layers.items():
        qt = ql.weight_q
        if method == "rtn":
            want = quantize(float_w[n], scheme, pad=True, scales=search_scales(float_w[n], scheme))
            assert torch.equal(qt.codes, want.codes) and torch.equal(qt.scale, want.scale)
        else:   # GPTQ's codes under its (searched) scales: what lowbit.quantize stores for their values
            again = quantize(qt.dequantize(), scheme, pad=True, scales=Scales(qt.scale, None, None, None))
            assert torch.equal(again.codes, qt.codes)
