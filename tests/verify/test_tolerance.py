"""Derived gates: they hold for correct arithmetic, and they have teeth."""
import pytest
import torch

import lowbit as lb
from lowbit.ops.reference import qlinear_reference
from lowbit.verify import tolerance as tol

MX = lb.get_preset("mxfp8")


def test_gamma_matches_definition():
    assert tol.gamma(10, 2.0 ** -24) == pytest.approx(10 * 2.0 ** -24 / (1 - 10 * 2.0 ** -24), rel=1e-15)
    assert tol.gamma(2 ** 11, 2.0 ** -11) == float("inf")


@pytest.mark.parametrize("xs,ws", [
    (lb.QuantScheme(format="int8", strategy="token"), lb.QuantScheme(format="int8", strategy="channel")),
    (lb.QuantScheme(format="int8", strategy="tensor"), lb.QuantScheme(format="int4", strategy="group", group_size=32)),
    (lb.QuantScheme(format="uint8", strategy="token", symmetric=False), lb.QuantScheme(format="int8", strategy="channel")),
    (MX, MX),
    (lb.QuantScheme(format="fp8_e4m3fn", strategy="tensor"), lb.QuantScheme(format="fp8_e5m2", strategy="channel")),
    (None, lb.get_preset("nvfp4")),
])
def test_deterministic_quantization_bound_holds_and_is_not_vacuous(rng, xs, ws):
    M, K, N = 23, 96, 29
    x = torch.randn(M, K, generator=rng) * torch.exp(torch.randn(M, 1, generator=rng))
    w = torch.randn(N, K, generator=rng) * torch.exp(2 * torch.rand(N, 1, generator=rng))
    xq = lb.quantize(x, xs) if xs else None
    wq = lb.quantize(w, ws)
    q = qlinear_reference(xq if xq is not None else x, wq)
    err = (q - x.double() @ w.double().T).abs()
    det, stat = tol.quantization_bounds(x, w, xq, wq)
    assert (err <= det).all()                 # worst case: must never fail
    assert (err / det).max() > 1e-3           # and not absurdly loose
    # per-element element bound holds too (the building block of the gate)
    b = tol.element_error_bound(w, wq)
    e = (w.double() - wq.dequantize(torch.float64)).abs()
    assert (e <= b.err.repeat_interleave(b.group, dim=1)).all()


def test_statistical_estimate_flags_one_scale_not_per_column(rng):
    M, K, N = 16, 512, 64
    x = torch.rand(M, K, generator=rng)
    # column gains spanning 256x (the matmul table uses 64x, where the one-scale fraction sits at 1-2;
    # a wider span keeps the test's margin on every seed)
    w = (2 * torch.rand(N, K, generator=rng) - 1) * torch.exp2(-8 * torch.arange(N) / (N - 1))[:, None]
    ref = x.double() @ w.double().T
    det, stat = tol.reference_gate(x, w)
    one = qlinear_reference(lb.quantize(x, lb.QuantScheme(format="int8", strategy="tensor")),
                            lb.quantize(w, lb.QuantScheme(format="int8", strategy="tensor")))
    col = qlinear_reference(lb.quantize(x, lb.QuantScheme(format="int8", strategy="tensor")),
                            lb.quantize(w, lb.QuantScheme(format="int8", strategy="channel")))
    assert ((one - ref).abs() / stat).max() > 1       # one scale fails the sqrt(K) diagnostic
    assert ((col - ref).abs() / stat).max() < 1       # per-column passes it
    assert ((col - ref).abs() / det).max() < 1        # and the deterministic gate


def _mx_kernel(xq, wq, acc_dtype):
    dx, dw = xq.decoded(), wq.decoded()
    acc = torch.zeros(dx.shape[0], dw.shape[0], dtype=acc_dtype)
    for j in range(xq.scale.shape[1]):
        part = torch.zeros_like(acc)
        for k in range(32 * j, 32 * j + 32):     # products accumulated one by one in acc_dtype
            part = (part.float() + dx[:, k:k + 1] * dw[:, k][None, :]).to(acc_dtype)
        acc = (acc.float() + part.float() * xq.scale[:, j:j + 1] * wq.scale[:, j][None, :]).to(acc_dtype)
    return acc.float()


def test_fp32_accumulated_mx_passes_fp16_accumulated_fails(rng):
    M, K, N = 6, 128, 10
    xq, wq = lb.quantize(torch.randn(M, K, generator=rng), MX), lb.quantize(torch.randn(N, K, generator=rng), MX)
    ref = qlinear_reference(xq, wq)
    gate = tol.implementation_gate(xq, wq, ref, accumulator="fp32")
    assert ((_mx_kernel(xq, wq, torch.float32).double() - ref).abs() <= gate).all()
    assert ((_mx_kernel(xq, wq, torch.float16).double() - ref).abs() > gate).any()


def test_int32_gate_is_epilogue_rounding_only(rng):
    M, K, N = 7, 300, 9
    xq = lb.quantize(torch.randn(M, K, generator=rng), lb.QuantScheme(format="int8", strategy="token"))
    wq = lb.quantize(torch.randn(N, K, generator=rng), lb.QuantScheme(format="int8", strategy="channel"))
    ref = qlinear_reference(xq, wq)
    gate = tol.implementation_gate(xq, wq, ref)
    acc = xq.codes.long() @ wq.codes.long().T
    out = (acc.float() * xq.scale) * wq.scale.T
    assert ((out.double() - ref).abs() <= gate).all()
    # one integer unit off in the accumulator is already over the gate
    off = ((acc + 1).float() * xq.scale) * wq.scale.T
    assert ((off.double() - ref).abs() > gate).all()


def test_bad_accumulator_name_raises(rng):
    xq = lb.quantize(torch.randn(2, 32, generator=rng), MX)
    with pytest.raises(ValueError, match="accumulator must be one of"):
        tol.rounding_count(xq, xq, "fp64", False)
    with pytest.raises(ValueError, match="int32"):
        tol.rounding_count(xq, xq, "int32", False)
