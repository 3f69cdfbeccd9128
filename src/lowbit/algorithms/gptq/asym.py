"""GPTQ toward the float model's outputs (asymmetric calibration, as in GPTAQ, Li et al. 2025).

Sequential GPTQ (lowbit.algorithms.gptq) fits each Linear to its own float weight on the inputs x~ that
the already-quantized model feeds it: loss sum_t ||(W - Q) x~_t||^2. The error the earlier layers
left in x~ is then kept, not corrected. Here the target is the FLOAT model's output of the layer,
W x_t with x_t the layer's input in the float model, so the loss is
    L(Q) = sum_t ||Q x~_t - W x_t||^2 / n.
With H~ = X~^T X~ / n and C = X^T X~ / n ([K, K], rows of X / X~ the tokens) and W' any weight with
W' H~ = W C, L(Q) = tr((W' - Q) H~ (W' - Q)^T) + const(Q) (expand both; the cross term is
-2 tr(Q C^T W^T) = -2 tr(Q H~ W'^T)), so GPTQ of the corrected weight W' on the Hessian H~ minimises
L with GPTQ's own machinery, codes and checks unchanged. W' is solved with a ridge on the correction,
    W' = W + W (C - H~) (H~ + lam I)^-1,   lam = damp * mean(diag H~),
the minimiser of sum_t ||W' x~_t - W x_t||^2 / n + lam ||W' - W||^2 (row by row: (H~ + lam I) w' =
C^T w + lam w): lam > 0 keeps the correction from fitting the few tokens (K = 1,536 inputs of a
down_proj on ~1,500 fit tokens), at the price that W' H~ = W C, so the identity above, holds only
as lam -> 0. Without quantization error upstream (x = x~: C = H~) W' = W, plain GPTQ. C and H~ use the
same fit tokens as GPTQ's Hessian (every holdout-th token left out), so the held-out check of
lowbit.algorithms.gptq stays on tokens the correction never saw; that check compares GPTQ's and round to
nearest's codes of W' by sum ||(W' - Q) x~||^2, L up to a cross term that vanishes on the fit
tokens only (an approximation on the held-out ones).

Cost: one float forward over the calibration batches before the sequential pass, keeping every
quantized Linear's float input (SmolLM2-135M, 2,048 tokens: ~0.8 GB float32), and per group of
Linears one extra [K, K] product, one Cholesky solve and one [N, K] x [K, K] product.
"""
from __future__ import annotations

import torch

from lowbit.archs.forward import run_batches


@torch.no_grad()
def float_inputs(model: torch.nn.Module, names: list[str], calib) -> dict[str, list[torch.Tensor]]:
    """{name: [input of that Linear for each calibration batch]} in the model as it is now (float),
    one forward per batch. Linears reading one tensor (q/k/v) share the stored tensor."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def make(n):
        def hook(mod, args):
            got[n].append(args[0].detach())
        return hook

    run_batches(model, calib, [model.get_submodule(n).register_forward_pre_hook(make(n)) for n in names])
    missing = [n for n, xs in got.items() if len(xs) != len(list(calib))]
    if missing:
        raise ValueError(f"Linear layers {missing[:4]} did not run once per calibration batch in the float model")
    return got


def corrected_weight(w: torch.Tensor, h: torch.Tensor, c: torch.Tensor, damp: float) -> torch.Tensor:
    """float64 W' = W + W (C - H~)(H~ + lam I)^-1, lam = damp * mean(diag H~): w [N, K] float weight,
    h = X~^T X~ / n and c = X^T X~ / n float64 [K, K] (module docstring)."""
    if not damp > 0:
        raise ValueError(f"damp={damp} must be > 0 (the ridge on the float-target correction)")
    K = h.shape[0]
    hd = h.double().clone()
    hd.diagonal().add_(damp * float(torch.diagonal(hd).mean()))
    L, info = torch.linalg.cholesky_ex(hd)
    if info:
        raise ValueError(f"H~ + lam I is not positive definite (damp={damp}); raise damp")
    w64 = w.detach().double()
    # W (C - H~) (H~ + lam I)^-1 = ((H~ + lam I)^-1 (C - H~)^T W^T)^T, H~ symmetric
    rhs = (c.double() - h.double()).T @ w64.T
    return w64 + torch.cholesky_solve(rhs, L).T.reshape(w64.shape[0], K)


def fit_moments(xq: list[torch.Tensor], xf: list[torch.Tensor], holdout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(H~, C) = (X~^T X~ / n, X^T X~ / n) float64 over the fit tokens (every holdout-th token of a
    batch, flattened, left out when holdout > 0, as gptq's Hessian), batches added in order."""
    K = xq[0].shape[-1]
    h = torch.zeros(K, K, dtype=torch.float64, device=xq[0].device)
    c = torch.zeros_like(h)
    n = 0
    for a, b in zip(xq, xf):
        if a.shape != b.shape:
            raise ValueError(f"quantized-model input {tuple(a.shape)} and float-model input {tuple(b.shape)} differ")
        a2, b2 = a.reshape(-1, K).double(), b.reshape(-1, K).to(a.device).double()
        if holdout:
            keep = torch.arange(a2.shape[0], device=a2.device) % holdout != holdout - 1
            a2, b2 = a2[keep], b2[keep]
        h += a2.T @ a2
        c += b2.T @ a2
        n += a2.shape[0]
    return h / n, c / n


def float_target_handler(model: torch.nn.Module, names: list[str], calib, inner, *, damp: float, holdout: int):
    """Wrap a lowbit.algorithms.sequential handler `inner` (gptq_handler): before it runs on a group, each
    Linear's weight is replaced by W' toward the float model's outputs, and restored after (the
    returned modules hold the quantized W'). The float inputs are captured now, on `model` as it
    is (call this before anything is quantized)."""
    xf = float_inputs(model, names, calib)

    def handle(group, inputs):
        h, c = fit_moments(inputs, xf[group[0]], holdout)
        lins = [model.get_submodule(n) for n in group]
        saved = [lin.weight.data for lin in lins]
        try:
            for lin in lins:
                lin.weight.data = corrected_weight(lin.weight, h, c, damp).to(lin.weight.dtype)
            return inner(group, inputs)
        finally:
            for lin, w in zip(lins, saved):
                lin.weight.data = w
            for n in group:
                xf[n] = []      # this group's float inputs are no longer needed

    handle.timings = getattr(inner, "timings", None)
    return handle
