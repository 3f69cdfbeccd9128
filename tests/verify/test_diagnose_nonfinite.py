"""Non-finite outputs from finite inputs are named first, where they start (verify/nonfinite.py),
and the finite outputs are diagnosed on their own; activation codes wrapped by a stale scale are
named (verify/bugs_rounding.stale_scale_wrap_hypotheses). Planted kernels build their bugs with
their own code: torchao's fp8 quantizer (the oracle the H200 audit caught), torch's float8 casts,
integer wraps by modular arithmetic."""
import pytest
import torch

import lowbit as lb
from accumulator_fixtures import hopper_fp8_mma
from lowbit.verify import check_linear

FP8R = lb.get_preset("fp8_row")
FP8_TOKEN = lb.QuantScheme("fp8_e4m3fn", "token", dynamic=True)
I8T = lb.QuantScheme(format="int8", strategy="token")
I8TEN = lb.QuantScheme(format="int8", strategy="tensor")
I8C = lb.QuantScheme(format="int8", strategy="channel")
I8G = lb.QuantScheme(format="int8", strategy="group", group_size=32)
SHAPES = [(13, 256, 21), (1, 320, 17), (37, 288, 10)]


def inputs(rng, M, K, N):
    x = torch.randn(M, K, generator=rng)
    return x, torch.randn(N, K, generator=rng) * torch.exp(torch.rand(N, 1, generator=rng) * 3)


def fp8_rowwise_no_floor(t):
    """Row-wise e4m3 with scale amax / 448 and no lower bound, then the float8 cast (torch's own):
    a zero row gets the scale 0 and the codes 0/0 = NaN. Returns (decoded elements, scales)."""
    s = t.abs().amax(dim=1, keepdim=True) / 448.0
    return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).float(), s


def kernel(X, SX, W, SW):
    """A float32 epilogue over exact float64 dot products: NaN / Inf propagate as in hardware."""
    return ((X.double() @ W.double().T).float() * SX) * SW.reshape(1, -1)


def names(v):
    return [c.name for c in v.causes]


def test_torchao_fp8_rowwise_zero_row_with_the_h200_accumulator(rng):
    """The H200 audit's cell: torchao's Float8Tensor quantizes the activations with
    _choose_scale_float8 (amax / 448, hp_value_lb None by default), so an all-zero token gets the
    scale 0 and NaN codes; cuBLAS's fp8 GEMM promotes its 14-bit accumulator every 128 K. Named
    zero_block_scale_nan first, the accumulator on the finite outputs second (was unexplained)."""
    qp = pytest.importorskip("torchao.quantization.quant_primitives")
    M, K, N = 12, 4096, 18
    x, w = torch.rand(M, K, generator=rng) + 0.5, torch.rand(N, K, generator=rng) + 0.5   # the audit's long-K sums
    # rows of different sizes: with amax ~1.5 in every row, one row's scale used for all (a stride-0
    # scale load) fitted the finite outputs as well as the accumulator did for some seeds (1655663148)
    x = x * torch.exp(torch.randn(M, 1, generator=rng))
    x[M // 2] = 0.0
    sx = qp._choose_scale_float8(x, [1, K], torch.float8_e4m3fn)
    X = qp._quantize_affine_float8(x, sx, torch.float8_e4m3fn).float()
    assert bool(torch.isnan(X[M // 2]).all())                  # torchao's own codes: 0/0
    wq = lb.quantize(w, FP8R)
    W, SW = wq.decoded(), wq.scale
    acc = hopper_fp8_mma(torch.nan_to_num(X), W, promote=128)
    acc[M // 2] = float("nan")                                 # a NaN element reaches its whole row
    out = (acc.float() * sx.reshape(-1, 1)) * SW.reshape(1, -1)
    v = check_linear(out, x, w, x_scheme=FP8_TOKEN, w_scheme=FP8R)
    assert not v.passed and v.kind == "logic", v.report()
    first = v.causes[0]
    assert first.name == "zero_block_scale_nan" and first.confirmed and f"[{M // 2}]" in first.detail, v.report()
    assert v.causes[1].name == "accumulator_narrower_than_promised", v.report()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_zero_rows_of_both_operands(rng, shape):
    M, K, N = shape
    x, w = inputs(rng, M, K, N)
    x[M // 2] = 0.0
    w[N // 3] = 0.0
    X, SX = fp8_rowwise_no_floor(x)
    W, SW = fp8_rowwise_no_floor(w)
    v = check_linear(kernel(X, SX, W, SW), x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert not v.passed and v.kind == "logic", v.report()
    assert names(v) == ["zero_block_scale_nan"] and v.causes[0].confirmed, v.report()
    assert "output rows" in v.causes[0].detail and "output columns" in v.causes[0].detail, v.report()


def test_zero_k_block_of_group_scales_reaches_every_output(rng):
    M, K, N = 9, 256, 14
    x, w = inputs(rng, M, K, N)
    x[:, 32:64] = 0.0
    s = x.reshape(M, -1, 32).abs().amax(dim=-1, keepdim=True) / 127.0           # no floor: 0
    X = torch.round(x.reshape(M, -1, 32) / s).clamp(-127, 127)                   # 0/0 = NaN
    wq = lb.quantize(w, I8C)
    out = ((X * s).reshape(M, K).double() @ wq.dequantize().double().T).float()
    v = check_linear(out, x, w, x_scheme=I8G, w_scheme=I8C)
    assert names(v)[0] == "zero_block_scale_nan" and v.causes[0].confirmed, v.report()
    assert "(0, 1)" in v.causes[0].detail, v.report()                          # the (row, group) block


def test_subnormal_scale_flushed_to_zero(rng):
    """e5m2 keeps x/0 = Inf as an Inf code (torch's e4m3fn cast saturates it to 448: that row is
    then finite and wrong, another bug); Inf codes sum to +-Inf or NaN, times the flushed scale 0: NaN."""
    e5 = lb.QuantScheme("fp8_e5m2", "token", dynamic=True)
    M, K, N = 10, 256, 12
    x, w = inputs(rng, M, K, N)
    x[3] *= 2.0 ** -130                       # amax / 57344 is subnormal in float32
    s = x.abs().amax(dim=1, keepdim=True) / 57344.0
    s = torch.where(s < 2.0 ** -126, torch.zeros_like(s), s)                     # flush-to-zero hardware
    X = (x / s).to(torch.float8_e5m2).float()
    wq = lb.quantize(w, FP8R)
    out = kernel(X, s, wq.decoded(), wq.scale)
    v = check_linear(out, x, w, x_scheme=e5, w_scheme=FP8R)
    assert names(v)[0] == "subnormal_scale_nonfinite" and v.causes[0].confirmed, v.report()
    assert v.kind == "logic" and "rows [3]" in v.causes[0].detail, v.report()
    # control: a kernel with lowbit's (finite, subnormal) scale passes on the same inputs
    xq = lb.quantize(x, e5)
    assert check_linear(kernel(xq.decoded(), xq.scale, wq.decoded(), wq.scale), x, w, x_scheme=e5,
                        w_scheme=FP8R).passed


def test_scale_overflowing_fp16(rng):
    M, K, N = 8, 128, 16
    x, w = inputs(rng, M, K, N)
    w[5] *= 1e8                               # amax / 127 ~ 1e6: Inf as an fp16 scale
    xq = lb.quantize(x, I8T)
    s = (w.abs().amax(dim=1, keepdim=True) / 127.0).half().float()              # scales kept in fp16
    W = torch.round(w / s).clamp(-127, 127)                                      # x/Inf = 0
    out = ((xq.codes.double() @ W.double().T).float() * xq.scale) * s.reshape(1, -1)   # 0 * Inf = NaN
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert names(v)[0] == "scale_overflow_nonfinite" and v.causes[0].confirmed, v.report()
    assert "[5]" in v.causes[0].detail


def test_fp16_output_overflow_is_numerical(rng):
    M, K, N = 6, 96, 9
    x, w = inputs(rng, M, K, N)
    x[2] *= 2000.0
    out = (x.double() @ w.double().T).to(torch.float16)
    assert not bool(torch.isfinite(out).all())
    v = check_linear(out, x, w)
    assert names(v)[0] == "output_overflow_inf" and v.kind == "numerical", v.report()


def test_nan_from_nowhere_is_located_not_named_after_a_scale(rng):
    M, K, N = 16, 128, 24
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    good = kernel(xq.decoded(), xq.scale, wq.decoded(), wq.scale)
    tile = good.clone()
    tile[8:12, 16:20] = float("nan")          # one tile's store from uninitialised memory
    v = check_linear(tile, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert names(v) == ["non_finite_output"] and not v.causes[0].confirmed, v.report()
    assert "rows 8..11, columns 16..19" in v.causes[0].detail, v.report()
    row = good.clone()
    row[4] = float("inf")                     # an Inf entered row 4 before the reduction
    v = check_linear(row, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert names(v) == ["non_finite_output"] and "every output of rows [4]" in v.causes[0].detail, v.report()


def test_nonfinite_first_then_a_finite_bug(rng):
    """A NaN row beside a missing weight scale elsewhere: both named, the NaN first."""
    M, K, N = 12, 160, 15
    x, w = inputs(rng, M, K, N)
    x[2] = 0.0
    X, SX = fp8_rowwise_no_floor(x)
    wq = lb.quantize(w, FP8R)
    out = kernel(X, SX, wq.decoded(), torch.ones_like(wq.scale))
    v = check_linear(out, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert names(v)[:2] == ["zero_block_scale_nan", "scale_missing"] and v.kind == "logic", v.report()
    assert v.causes[1].detail.startswith("on the finite outputs"), v.report()


# ------------------------------------------------------------------------- wrapped activation codes
def _wrap8(q):
    return (q.to(torch.int64) + 128) % 256 - 128


def _int8_kernel(X, SX, wq):
    return ((X.to(torch.int64) @ wq.codes.to(torch.int64).T).to(torch.float32) * SX) * wq.scale.reshape(1, -1)


def w_static_tensor(x):
    return (x.abs().max() * 0.9 / 127).reshape(1, 1), I8TEN          # calibrated on 90% of the range


def w_one_token_over(x):
    s = (x.abs().max() * 1.02 / 127).reshape(1, 1)                    # 2% headroom; one token 5% past it
    x[x.shape[0] // 2, 5] = 1.05 * 127 * float(s)
    return s, I8TEN


def w_short_per_token(x):
    # every token's largest value rounds to ~133 and wraps; each token's scale is fitted on its own
    return x.abs().amax(dim=1, keepdim=True) / (1.05 * 127), I8T


WRAPS = {"static per-tensor scale": w_static_tensor, "one token past a calibrated scale": w_one_token_over,
         "per-token scales 5% short": w_short_per_token}


# The stale scale is fitted from each token's outputs: with fewer output columns than the ~16 largest
# values that may have wrapped (N = 10) several scales fit and the wrap is left unnamed, not misnamed.
@pytest.mark.parametrize("case", sorted(WRAPS))
@pytest.mark.parametrize("shape", [(13, 256, 21), (24, 320, 33)], ids=lambda s: "x".join(map(str, s)))
def test_activation_codes_wrapped_are_named(rng, case, shape):
    M, K, N = shape
    x, w = inputs(rng, M, K, N)
    s, scheme = WRAPS[case](x)
    q = torch.round(x / s)
    if not bool((q.abs() > 127).any()):
        pytest.skip("no value past the stale range in this draw")
    wq = lb.quantize(w, I8C)
    v = check_linear(_int8_kernel(_wrap8(q), s, wq), x, w, x_scheme=scheme, w_scheme=I8C)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "codes_wrapped_not_clamped" and v.causes[0].confirmed, v.report()
    assert "activations x" in v.causes[0].detail
    # control: the same stale scale with a clamp is a different (unnamed-wrap) error, never a wrap
    clamped = check_linear(_int8_kernel(q.clamp(-127, 127), s, wq), x, w, x_scheme=scheme, w_scheme=I8C)
    assert "codes_wrapped_not_clamped" not in names(clamped), clamped.report()
