"""qlinear_reference against independent oracles: exact Python-integer dot products (int paths,
bit-exact), ml_dtypes-decoded fp8 values with fractions.Fraction sums (float paths)."""
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.ops.reference import exact_int_matmul, qlinear_reference
from lowbit.verify.tolerance import gamma


def _int_oracle(xq, wq):
    """Exact rational result from Python ints and Fractions of the float32 scales."""
    qx = xq.codes.to(torch.int64).tolist()
    qw = wq.codes.to(torch.int64).tolist()
    sx = xq.expanded_scale().double().tolist()
    sw = wq.expanded_scale().double().tolist()
    zx = xq.expanded_zero_point().tolist() if xq.zero_point is not None else None
    M, K, N = len(qx), len(qx[0]), len(qw)
    out = np.zeros((M, N))
    for m in range(M):
        for n in range(N):
            acc = Fraction(0)
            for k in range(K):
                a = qx[m][k] - (zx[m][k] if zx else 0)
                acc += Fraction(a * qw[n][k]) * Fraction(sx[m][k]) * Fraction(sw[n][k])
            out[m, n] = float(acc)
    return torch.from_numpy(out)


@pytest.mark.parametrize("xs,ws", [
    (lb.QuantScheme(format="int8", strategy="token"), lb.QuantScheme(format="int8", strategy="channel")),
    (lb.QuantScheme(format="uint8", strategy="token", symmetric=False), lb.QuantScheme(format="int8", strategy="channel")),
    (lb.QuantScheme(format="int8", strategy="group", group_size=16), lb.QuantScheme(format="int4", strategy="group", group_size=32)),
])
def test_integer_reference_matches_exact_rational(rng, xs, ws):
    M, K, N = 5, 64, 7
    x = torch.randn(M, K, generator=rng) + 0.3
    w = torch.randn(N, K, generator=rng)
    xq, wq = lb.quantize(x, xs), lb.quantize(w, ws)
    got = qlinear_reference(xq, wq)
    want = _int_oracle(xq, wq)
    # per block the integer sum is exact; each block's two scale multiplies and the sum over
    # nb blocks round in float64: |err| <= (nb + 2) * 2^-53 * sum|terms| (Higham gamma)
    nb = K // 16
    T = (xq.dequantize(torch.float64).abs() @ wq.dequantize(torch.float64).abs().T)
    assert ((got - want).abs() <= (nb + 2) * 2.0 ** -53 * T * 1.0001).all()


def test_int8_channel_reference_is_bit_exact_integer_times_scales(rng):
    M, K, N = 9, 203, 11
    xq = lb.quantize(torch.randn(M, K, generator=rng), lb.QuantScheme(format="int8", strategy="token"))
    wq = lb.quantize(torch.randn(N, K, generator=rng), lb.QuantScheme(format="int8", strategy="channel"))
    acc = (xq.codes.to(torch.int64) @ wq.codes.to(torch.int64).T)   # exact int64 oracle
    want = acc.double() * (xq.scale.double() * wq.scale.double().T)  # scale product exact in float64
    assert torch.equal(qlinear_reference(xq, wq), want)


def test_fp8_reference_matches_ml_dtypes_decoded_fractions(rng):
    mx = lb.get_preset("mxfp8")
    M, K, N = 3, 64, 4
    xq = lb.quantize(torch.randn(M, K, generator=rng) * 3, mx)
    wq = lb.quantize(torch.randn(N, K, generator=rng), mx)
    dx = xq.codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)  # independent decoder
    dw = wq.codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sx = xq.expanded_scale().double().numpy()
    sw = wq.expanded_scale().double().numpy()
    got = qlinear_reference(xq, wq)
    for m in range(M):
        for n in range(N):
            exact = sum(Fraction(float(dx[m, k])) * Fraction(float(dw[n, k])) * Fraction(float(sx[m, k]))
                        * Fraction(float(sw[n, k])) for k in range(K))
            # power-of-two scales: every block product is exact, only the 2 block sums per group
            # and the adds across 2 groups round: <= 4 * 2^-53 * sum |terms|
            T = float(np.abs(dx[m] * sx[m]) @ np.abs(dw[n] * sw[n]))
            assert abs(float(got[m, n]) - float(exact)) <= 4 * 2.0 ** -53 * T


def test_exact_int_matmul_chunks_beyond_2_53(rng):
    # values near 2^26: a single product ~2^52, K=64 sums overflow 2^53 in float64 BLAS
    a = torch.randint(-(2 ** 26), 2 ** 26, (3, 64), generator=rng, dtype=torch.int64)
    b = torch.randint(-(2 ** 26), 2 ** 26, (4, 64), generator=rng, dtype=torch.int64)
    got = exact_int_matmul(a.double(), b.double(), 2.0 ** 26, 2.0 ** 26)
    want = [[sum(int(a[i, k]) * int(b[j, k]) for k in range(64)) for j in range(4)] for i in range(3)]
    assert all(got[i, j].item() == float(want[i][j]) for i in range(3) for j in range(4))


def test_plain_side_and_bias_and_leading_dims(rng):
    x = torch.randn(2, 3, 32, generator=rng)
    w = torch.randn(5, 32, generator=rng)
    bias = torch.randn(5, generator=rng)
    wq = lb.quantize(w, lb.QuantScheme(format="int8", strategy="channel"))
    got = qlinear_reference(x, wq, bias)
    want = x.double() @ wq.dequantize(torch.float64).T + bias.double()
    assert got.shape == (2, 3, 5)
    # Each side is a float64 dot of K = 32 terms plus the bias: K products and sums and the bias
    # add, K + 2 roundings of 2^-53 relative to sum |terms| (to first order); got and want are two
    # such computations, so they differ by at most twice that.
    K = x.shape[-1]
    T = x.double().abs() @ wq.dequantize(torch.float64).abs().T + bias.double().abs()
    assert ((got - want).abs() <= 2 * gamma(K + 2, 2.0 ** -53) * T).all()


def test_bad_inputs_raise_clear_errors(rng):
    wq = lb.quantize(torch.randn(4, 32, generator=rng), lb.QuantScheme(format="int8", strategy="channel"))
    with pytest.raises(ValueError, match="contraction sizes differ"):
        qlinear_reference(torch.randn(2, 16), wq)
    with pytest.raises(ValueError, match="bias must have shape"):
        qlinear_reference(torch.randn(2, 32), wq, bias=torch.ones(3))
    with pytest.raises(ValueError, match="NaN or Inf"):
        qlinear_reference(torch.full((2, 32), float("nan")), wq)
