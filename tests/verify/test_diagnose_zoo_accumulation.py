"""Kernels that really accumulate in fp16 / bf16 (in the summation orders of common kernels), run a
half-precision matmul of dequantized values, round stochastically, or add a stray constant at long
K: each planted with numpy's float16 arithmetic or torch casts written here, never with the
diagnosis' simulations, and named by check_linear.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.verify import check_linear

I8T = lb.QuantScheme(format="int8", strategy="token")
I8C = lb.QuantScheme(format="int8", strategy="channel")


def half_inputs(rng, M, K, N):
    """x, w exactly representable in bf16 and fp16 (a half-precision kernel sees them unrounded)."""
    x = torch.randn(M, K, generator=rng).bfloat16().float()
    w = (torch.randn(N, K, generator=rng) * 0.5).bfloat16().float()
    return x, w


def seq_products(X, W, dt):
    """acc = dt(acc + dt(x_k * w_k)), one k at a time, in numpy's dt arithmetic."""
    a, b = X.numpy().astype(dt), W.numpy().astype(dt)
    acc = np.zeros((a.shape[0], b.shape[0]), dtype=dt)
    for k in range(a.shape[1]):
        acc = (acc + (a[:, k, None] * b[None, :, k]).astype(dt)).astype(dt)
    return torch.from_numpy(acc.astype(np.float32))


def pairwise(X, W, dt):
    """Products rounded to dt, then summed by halving (a reduction tree), every node in dt."""
    p = (X.numpy().astype(dt)[:, None, :] * W.numpy().astype(dt)[None, :, :]).astype(dt)
    while p.shape[-1] > 1:
        if p.shape[-1] % 2:
            p = np.concatenate([p, np.zeros(p.shape[:-1] + (1,), dtype=dt)], axis=-1)
        p = (p[..., 0::2] + p[..., 1::2]).astype(dt)
    return torch.from_numpy(p[..., 0].astype(np.float32))


def tiled(X, W, dt, tile):
    """acc += tile partial, each partial summed from zero in 16-wide steps (exact step sums
    rounded to dt), all in dt."""
    a, b = X.double().numpy(), W.double().numpy()
    acc = np.zeros((a.shape[0], b.shape[0]), dtype=dt)
    for t in range(0, a.shape[1], tile):
        part = np.zeros_like(acc)
        for c in range(t, min(t + tile, a.shape[1]), 16):
            e = min(c + 16, t + tile, a.shape[1])
            part = (part.astype(np.float64) + a[:, c:e] @ b[:, c:e].T).astype(dt)
        acc = (acc.astype(np.float64) + part.astype(np.float64)).astype(dt)
    return torch.from_numpy(acc.astype(np.float32))


BF16 = ml_dtypes.bfloat16
KERNELS = {"fp16 sequential, products rounded": lambda X, W: seq_products(X, W, np.float16),
           "bf16 sequential, products rounded": lambda X, W: seq_products(X, W, BF16),
           "fp16 pairwise": lambda X, W: pairwise(X, W, np.float16),
           "fp16 64-wide K tiles": lambda X, W: tiled(X, W, np.float16, 64),
           "bf16 32-wide K tiles": lambda X, W: tiled(X, W, BF16, 32)}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
# The GEMV shape needs enough outputs for the check to see the kernel: the fp16 64-wide-tile
# kernel's error stays inside the fp32 gate in about 62% of outputs (measured over 40 seeds x 64
# outputs), so all of 9 outputs pass for ~1% of seeds; all of 33 for ~1e-7.
@pytest.mark.parametrize("shape", [(6, 300, 11), (1, 517, 33)], ids=lambda s: "x".join(map(str, s)))
def test_real_half_accumulation_is_named_and_reproduced(rng, kernel, shape):
    M, K, N = shape
    x, w = half_inputs(rng, M, K, N)
    out = KERNELS[kernel](x, w)
    acc = kernel[:4]
    v = check_linear(out, x, w, accumulator="fp32")
    assert not v.passed and v.kind == "numerical", v.report()
    c = v.causes[0]
    assert c.name == "accumulator_narrower_than_promised" and c.confirmed and f"a {acc} accumulator" in c.detail, \
        v.report()
    assert check_linear(out, x, w, accumulator=acc).passed, "declared honestly, the kernel passes"


def test_int8_dequantized_then_accumulated_in_fp16_is_named(rng):
    M, K, N = 5, 256, 12
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng) * 0.1
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    Xd = xq.codes.float() * xq.scale                     # dequantized in fp32, then an fp16 GEMM loop
    Wd = wq.codes.float() * wq.scale
    out = seq_products(Xd, Wd, np.float16)
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "numerical", v.report()
    c = v.causes[0]
    assert c.name == "accumulator_narrower_than_promised" and c.confirmed and "fp16" in c.detail, v.report()


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(7, 384, 19), (1, 200, 33)], ids=lambda s: "x".join(map(str, s)))
def test_dequantize_then_half_matmul_is_named(rng, dt, shape):
    M, K, N = shape
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    Xh = (xq.codes.float() * xq.scale).to(dt)           # the kernel: dequantize to half, float matmul
    Wh = (wq.codes.float() * wq.scale).to(dt)
    out = (Xh.double() @ Wh.double().T).float()
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "numerical", v.report()
    c = v.causes[0]
    assert c.name == "dequantized_then_half_matmul" and c.confirmed, v.report()
    assert ("fp16" if dt == torch.float16 else "bf16") in c.detail, v.report()


def test_dequantize_then_fp16_matmul_on_a_sample_of_a_large_output(rng, monkeypatch):
    # the large-shape path: hypotheses run on sampled rows and columns
    from lowbit.verify import diagnose
    monkeypatch.setattr(diagnose, "SAMPLE_WORK", 0)
    monkeypatch.setattr(diagnose, "SAMPLE_ROWS", 8)
    monkeypatch.setattr(diagnose, "SAMPLE_COLS", 32)
    M, K, N = 24, 1024, 96
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    out = ((xq.codes.float() * xq.scale).half().double() @ (wq.codes.float() * wq.scale).half().double().T).half()
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert v.causes[0].name == "dequantized_then_half_matmul" and v.causes[0].confirmed, v.report()
    assert "different_quantization" not in [c.name for c in v.causes if c.confirmed], v.report()


def test_stray_constant_at_long_k_is_a_logic_offset_not_an_accumulator(rng):
    M, K, N = 8, 4096, 16
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    acc = (xq.codes.double() @ wq.codes.double().T).float()
    out = acc * xq.scale * wq.scale.T + 1.0
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "output_offset" and v.causes[0].confirmed and "+1" in v.causes[0].detail, v.report()
    assert "accumulator_narrower_than_promised" not in [c.name for c in v.causes], v.report()


def _sr_kernel(rng, M, K, N, rule):
    x, w = torch.randn(M, K, generator=rng), torch.randn(N, K, generator=rng)
    s = x.abs().amax(dim=1, keepdim=True) / 127.0
    v = x / s
    X = torch.floor(v + torch.rand(v.shape, generator=rng)) if rule == "stochastic" else torch.trunc(v)
    wq = lb.quantize(w, I8C)
    out = ((X.double() @ wq.codes.double().T).float() * s) * wq.scale.T
    return out, x, w


def test_truncation_at_a_larger_shape_is_truncation(rng):
    out, x, w = _sr_kernel(rng, 32, 256, 40, "trunc")
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "quantizer_truncates" and v.causes[0].confirmed, v.report()
    assert not [c.name for c in v.causes if c.confirmed and c.name != "quantizer_truncates"], v.report()


def test_stochastic_rounding_is_listed_as_consistent_never_as_reproduced(rng):
    # a random process cannot be reproduced: the verdict stays unexplained, with stochastic
    # rounding the first candidate, consistent in size
    out, x, w = _sr_kernel(rng, 32, 256, 40, "stochastic")
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "unexplained_logic_error", v.report()
    assert v.causes[1].name == "stochastic_rounding" and not v.causes[1].confirmed, v.report()
    assert not [c for c in v.causes if c.confirmed], v.report()


def test_stochastic_rounding_is_not_claimed_on_few_outputs(rng):
    # 5 x 24 outputs cannot tell stochastic rounding's error size from round-to-nearest's
    out, x, w = _sr_kernel(rng, 5, 256, 24, "stochastic")
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed, v.report()
    assert "stochastic_rounding" not in [c.name for c in v.causes if c.confirmed], v.report()


def test_round_half_rounds_float64_once(rng):
    # numpy converts float64 to float16 directly (one rounding); torch goes through float32
    from lowbit.verify.accumulate import round_half
    t = torch.randn(100000, generator=rng, dtype=torch.float64) * 100
    want = torch.from_numpy(t.numpy().astype(np.float16).astype(np.float64))
    assert torch.equal(round_half(t, torch.float16), want)
