"""GPTQ toward the float model's outputs (lowbit.algorithms.gptq.asym): the corrected weight solves its
ridge problem (normal equations, residual within the float64 rounding bound), lowers the
asymmetric loss, the moments are the fit tokens' X~^T X~ / n and X^T X~ / n, and at model level
every layer's stored codes are, bit for bit, GPTQ of the corrected weight on the inputs the
quantized model feeds that layer, with the float model's inputs as targets; a layer with nothing
quantized upstream gets plain GPTQ's codes."""
import copy

import pytest
import torch

from lowbit.algorithms.gptq import asym as gptq_asym
from lowbit.algorithms.gptq.hessian import HessianAccumulator
from lowbit.algorithms.gptq.model import gptq_model
from lowbit.algorithms.gptq.solver import gptq_quantize_group
from lowbit.recipes.presets import get_recipe
from algorithms.test_gptq import _batches, linear_inputs, tiny_llama

U = 2.0 ** -53


def _gamma(k: int) -> float:
    return k * U / (1 - k * U)


def _toy(rng, N=6, K=9, n=40):
    """A weight, float inputs X and quantized-model inputs X~ = X + noise (an upstream error)."""
    A = torch.randn(K, K, generator=rng, dtype=torch.float64)
    X = torch.randn(n, K, generator=rng, dtype=torch.float64) @ A
    Xq = X + 0.05 * torch.randn(n, K, generator=rng, dtype=torch.float64) * X.abs().mean()
    return torch.randn(N, K, generator=rng, dtype=torch.float64), X, Xq


def test_corrected_weight_solves_the_ridge_problem(rng):
    w, X, Xq = _toy(rng)
    n, K = X.shape
    h, c = Xq.T @ Xq / n, X.T @ Xq / n
    damp = 0.1
    wp = gptq_asym.corrected_weight(w, h, c, damp)
    lam = damp * float(torch.diagonal(h).mean())
    A = h + lam * torch.eye(K, dtype=torch.float64)
    x = (wp - w).T                     # the correction, [K, N]
    b = (c - h).T @ w.T
    r = A @ x - b
    # Bound on |r| elementwise. The solve is a Cholesky solve of A (formed with one rounding of
    # its diagonal: |dA| <= u |A|) against b (computed: |db| <= gamma_{K+1} |C - H|^T |W|^T, the
    # subtraction and K-term products); Higham Thm 10.4: (A + dA') x^ = b^, |dA'| <= gamma_{3K+1}
    # |L||L^T|. x is then recovered as (w + x^) - w: |dx| <= u |w'| (one rounding of the sum,
    # the subtraction exact by Sterbenz or rounded once: 2u). The test's own A @ x - b adds
    # gamma_{K+1} (|A||x| + |b|).
    L = torch.linalg.cholesky(A)
    bound = (_gamma(3 * K + 1) * (L.abs() @ L.abs().T) @ x.abs() + U * A.abs() @ x.abs()
             + _gamma(K + 1) * (c - h).abs().T @ w.abs().T + 2 * U * A.abs() @ wp.abs().T
             + _gamma(K + 1) * (A.abs() @ x.abs() + b.abs()))
    assert (r.abs() <= bound).all()
    # the ridge solution never raises the objective above W's: f(W') <= f(W) = L(W)
    loss = lambda v: float(((Xq @ v.T - X @ w.T) ** 2).sum() / n)  # noqa: E731
    assert loss(wp) + lam * float(((wp - w) ** 2).sum()) <= loss(w) * (1 + 4 * _gamma(K + n))
    # no upstream error: C = H~ bit for bit, so the correction is exactly 0
    assert torch.equal(gptq_asym.corrected_weight(w, h, h.clone(), damp), w)
    with pytest.raises(ValueError, match="damp"):
        gptq_asym.corrected_weight(w, h, c, 0.0)


def test_fit_moments(rng):
    w, X, Xq = _toy(rng, n=37)
    xs, xqs = [X[:20].reshape(4, 5, -1).float(), X[20:].float()], [Xq[:20].reshape(4, 5, -1).float(), Xq[20:].float()]
    for holdout in (0, 3):
        h, c = gptq_asym.fit_moments(xqs, xs, holdout)
        keep = [torch.arange(t.reshape(-1, 9).shape[0]) % holdout != holdout - 1 if holdout else
                torch.ones(t.reshape(-1, 9).shape[0], dtype=torch.bool) for t in xs]
        a = torch.cat([t.reshape(-1, 9)[k] for t, k in zip(xqs, keep)]).double()
        b = torch.cat([t.reshape(-1, 9)[k] for t, k in zip(xs, keep)]).double()
        m = a.shape[0]
        # two float64 summation orders of m exact products (float32 inputs): each within
        # gamma_m |.|^T|.| / m of the exact sum, so within twice that of each other
        assert ((h - a.T @ a / m).abs() <= 2 * _gamma(m) * (a.abs().T @ a.abs()) / m).all()
        assert ((c - b.T @ a / m).abs() <= 2 * _gamma(m) * (b.abs().T @ a.abs()) / m).all()
    with pytest.raises(ValueError, match="differ"):
        gptq_asym.fit_moments([Xq[:4]], [X[:5]], 0)


def test_model_codes_are_gptq_of_the_corrected_weight(rng):
    """gptq_model(targets="float") on a one-layer Llama: each Linear's codes = gptq_quantize_group of
    the corrected weights (moments of that layer's inputs in the finished quantized model and in
    the float model), bit for bit; layer 0's q/k/v (nothing quantized upstream) = plain GPTQ's."""
    model = tiny_llama(rng, layers=1)
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    batches = _batches(rng, n=2, t=32)
    opts = dict(holdout=0, damp=0.1)      # no held-out fallback: every layer keeps GPTQ's codes
    summary = gptq_model(model, "w4a16-g32", batches, targets="float", **opts)
    gptq_model(plain, "w4a16-g32", batches, **opts)
    names = [d.name for d in summary.quantized]
    seen_q, seen_f = linear_inputs([model, ref], names, batches)
    scheme = get_recipe("w4a16-g32").weight
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    differ = 0
    for g in groups:
        full = [f"model.layers.0.{n}" for n in g]
        h, c = gptq_asym.fit_moments(seen_q[full[0]], seen_f[full[0]], 0)
        ws = [gptq_asym.corrected_weight(ref.get_submodule(n).weight, h, c, 0.1).float() for n in full]
        acc = HessianAccumulator(h.shape[0])     # GPTQ's Hessian, as gptq_handler sums it (holdout 0)
        for x in seen_q[full[0]]:
            acc.add(x.reshape(-1, h.shape[0]))
        want = gptq_quantize_group(ws, acc.hessian(), [scheme] * len(ws), damp=0.1, act_order=True)
        for n, qt in zip(full, want):
            got = model.get_submodule(n).weight_q
            assert torch.equal(got.codes, qt.codes) and torch.equal(got.scale, qt.scale), n
            differ += not torch.equal(got.codes, plain.get_submodule(n).weight_q.codes)
        if g[0] == "self_attn.q_proj":
            assert differ == 0      # inputs equal to the float model's: C = H~, W' = W
    assert differ > 0
    with pytest.raises(ValueError, match="targets="):
        gptq_model(copy.deepcopy(ref), "w4a16-g32", batches, targets="floats")
