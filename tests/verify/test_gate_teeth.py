"""Gates with teeth: every gate is an upper bound (other tests) AND within a stated factor of the
worst error a correct kernel reaches on adversarial inputs, so a gate made looser (an 8x larger
unit roundoff, a doubled quantization bound) fails here; an error just above a gate is caught."""
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.ops.reference import qlinear_reference
from lowbit.verify import check_linear
from lowbit.verify import tolerance as tol

I8 = lb.QuantScheme(format="int8", strategy="tensor")


def _adversarial_fp32_sum(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Terms p_k ~ c and their sequential float32 sum such that EVERY addition rounds down by
    almost half an ulp of the running sum: p_k = c + (just under half an ulp of acc + c).
    Returns (terms [R, K] float32, sums [R] float32)."""
    R, K = c.shape
    acc = np.zeros(R, dtype=np.float32)
    p = np.empty((R, K), dtype=np.float32)
    for k in range(K):
        ulp = np.spacing((acc + c[:, k]).astype(np.float32))
        p[:, k] = (c[:, k] + 0.49 * ulp).astype(np.float32)
        acc = (acc + p[:, k]).astype(np.float32)
    return p, acc


def test_fp32_gate_is_within_4x_of_an_adversarial_sequential_sum(rng):
    # gamma_K(u) * sum|p| ~ K^2 u c; a sequential sum that rounds down by ~0.49 ulp each step
    # loses sum_k 0.49 ulp(k c) ~ 0.37 K^2 u c (ulp(v) averages 1.5 u v over a binade; u = 2^-24):
    # the gate may exceed the worst correct error by 1 / 0.37 < 4, no more.
    K = 2048
    # integer c keeps the running sum on its own grid, so only the added 0.49 ulp rounds
    c = torch.randint(1, 4, (3, K), generator=rng).numpy().astype(np.float32)
    p, s = _adversarial_fp32_sum(c)
    x, w = torch.from_numpy(p), torch.ones(1, K)
    out = torch.from_numpy(s)[:, None]
    v = check_linear(out, x, w)                       # fp32 promised, nothing quantized
    assert v.passed, v.report()
    assert v.metrics["impl_gate_frac"] > 0.25, v.report()


def test_int32_epilogue_gate_is_within_2x_of_the_worst_epilogue_rounding(rng):
    # int8 x int8 with |acc| > 2^24: float32(acc), * s_x, * s_w round three times; with positive
    # codes T = |ref|, the gate is (3 u + u_out) T = 4u T. Three roundings of relative size up to u
    # each (uniform over the binade) reach ~2.6u at the worst of 4096 outputs (0.65 of the gate on
    # the seeds printed, > 0.5 on 200 seeds); a gate counting twice the epilogue roundings (7u)
    # would put the ratio below 0.4, so the factor asserted is 2 (0.5).
    M, K, N = 64, 2048, 64
    x = torch.rand(M, K, generator=rng) + 1.0
    w = torch.rand(N, K, generator=rng) + 1.0
    xq, wq = lb.quantize(x, I8), lb.quantize(w, I8)
    acc = xq.codes.long() @ wq.codes.long().T
    assert acc.min() > 2 ** 24                               # the conversion itself rounds
    out = (acc.to(torch.float32) * xq.scale) * wq.scale
    v = check_linear(out, x, w, x_scheme=I8, w_scheme=I8)
    assert v.passed, v.report()
    assert v.metrics["impl_gate_frac"] > 0.5, v.report()


def test_quantization_bound_is_reached_by_half_step_inputs(rng):
    # every x and w element half a step (minus 0.001) above a grid point, all positive: each term
    # errs by ~ (E_x W + X E_w) and the deterministic bound sums exactly those: ratio ~ 0.99
    M, K, N = 5, 300, 7
    sx, sw = 0.013, 0.021
    # codes 120..126 against the pinned 127: each term reaches >= 120.5/127.25 of its bound
    a = torch.randint(120, 127, (M, K), generator=rng).float()
    b = torch.randint(120, 127, (N, K), generator=rng).float()
    x, w = (a + 0.499) * sx, (b + 0.499) * sw
    x[:, 0], w[:, 0] = 127 * sx, 127 * sw                   # pin each row's amax (channel scales)
    xs, ws = lb.QuantScheme(format="int8", strategy="token"), lb.QuantScheme(format="int8", strategy="channel")
    xq, wq = lb.quantize(x, xs), lb.quantize(w, ws)
    err = (qlinear_reference(xq, wq) - x.double() @ w.double().T).abs()
    det, _ = tol.quantization_bounds(x, w, xq, wq)
    assert (err <= det).all()
    assert float((err / det).min()) > 0.9


def test_an_error_just_above_the_gate_is_caught_and_just_below_is_not(rng):
    M, K, N = 6, 96, 5
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    xs, ws = lb.QuantScheme(format="int8", strategy="token"), lb.QuantScheme(format="int8", strategy="channel")
    xq, wq = lb.quantize(x, xs), lb.quantize(w, ws)
    ref = qlinear_reference(xq, wq)
    gate = tol.implementation_gate(xq, wq, ref, out_dtype=torch.float64)
    r, c = int(torch.randint(M, (1,), generator=rng)), int(torch.randint(N, (1,), generator=rng))
    for f, ok in ((0.99, True), (1.01, False)):
        out = ref.clone()
        out[r, c] += f * gate[r, c]
        v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws)
        assert v.passed is ok, v.report()
        if not ok:
            assert v.first_failure == (r, c)


def test_nan_and_inf_outputs_fail_where_they_are(rng):
    x, w = torch.randn(4, 64, generator=rng), torch.randn(6, 64, generator=rng)
    for bad in (float("nan"), float("inf")):
        out = x @ w.T
        out[2, 3] = bad
        v = check_linear(out, x, w)
        assert not v.passed and v.first_failure == (2, 3), v.report()


# An exact int8 kernel whose result is rounded once to the output dtype; among 4096 outputs the
# worst error reaches > 0.75 of the gate:
# - bf16 output of ~unit outputs: the error is the output rounding, up to u_bf16 * |ref| (2^-8
#   relative at the bottom of a binade); measured 0.968 .. 0.995 over 40 seeds; a doubled
#   output-rounding term would cap it at 0.5;
# - fp16 output of ~1e-6 outputs, where fp16's spacing is its smallest subnormal 2^-24: the error is
#   up to eta/2 = 2^-25, which dominates the gate (u_fp16 |ref| ~ 5e-10); measured 0.993 .. 0.999
#   over 40 seeds; a 4x larger underflow term would cap it at 0.25.
@pytest.mark.parametrize("dtype,sx,sw", [(torch.bfloat16, 1.0, 1.0), (torch.float16, 1e-4, 1e-3)],
                         ids=["bf16 output rounding", "fp16 subnormal underflow"])
def test_output_rounding_and_underflow_terms_are_reached(rng, dtype, sx, sw):
    M, K, N = 64, 96, 64
    x, w = torch.randn(M, K, generator=rng) * sx, torch.randn(N, K, generator=rng) * sw
    xs, ws = lb.QuantScheme(format="int8", strategy="token"), lb.QuantScheme(format="int8", strategy="channel")
    xq, wq = lb.quantize(x, xs), lb.quantize(w, ws)
    out = qlinear_reference(xq, wq).to(dtype)
    v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws)
    assert v.passed, v.report()
    assert v.metrics["impl_gate_frac"] > 0.75, v.report()


def test_float_element_bound_is_reached_by_half_step_fp8_inputs(rng):
    # fp8 e4m3 with scale 1 (amax pinned at 448): elements in the top binade [256, 448) sit 15.9
    # above a grid point (spacing 32), all positive. The bound charges u_e4m3 * amax = 28 per
    # element (E_x W + X E_w + E_x E_w = 2 * 28 * 448 + 28^2 per product); the actual error is
    # 15.9 * (x + w) + 15.9^2 with x, w ~ 400..432: 0.496 .. 0.498 of the bound over 30 seeds (> 0.45
    # asserted); doubled it would be < 0.3
    M, K, N = 4, 200, 6
    fp8 = lb.QuantScheme(format="fp8_e4m3fn", strategy="channel")
    a = torch.randint(4, 6, (M, K), generator=rng).float()
    b = torch.randint(4, 6, (N, K), generator=rng).float()
    x, w = 256 + 32 * a + 15.9, 256 + 32 * b + 15.9
    x[:, 0], w[:, 0] = 448.0, 448.0
    xq, wq = lb.quantize(x, fp8), lb.quantize(w, fp8)
    assert bool((xq.scale == 1).all() and (wq.scale == 1).all())
    err = (qlinear_reference(xq, wq) - x.double() @ w.double().T).abs()
    det, _ = tol.quantization_bounds(x, w, xq, wq)
    assert (err <= det).all()
    assert float((err / det).min()) > 0.45
