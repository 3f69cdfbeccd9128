"""QuantLinear against independent oracles (a numpy int8 GEMM, torch's float8 cast)
and against lowbit's float64 quantization-aware reference, with tolerances derived below."""
import numpy as np
import pytest
import torch

from lowbit.nn import QuantLinear, get_recipe
from lowbit.algorithms.static_scales import clipping_report
from lowbit.quantize import quantize_static, scale_from_absmax, static_scheme
from lowbit.ops.reference import qlinear_reference, sum_abs_products
from lowbit.quantize import quantize

U32 = 2.0 ** -24   # float32 unit roundoff


def _linear(rng, n, k, bias=True):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=rng) * 0.1)
    return lin


def _acts(rng, m, k):
    x = torch.randn(m, k, generator=rng)
    x[:, int(torch.randint(0, k, (1,), generator=rng))] *= 30.0   # one outlier channel, as in LLMs
    return x


def test_int8_path_matches_numpy_seed_gemm(rng):
    """W8A8 int8 on the CPU: codes bit-exact to numpy quantizers written here, output within the
    float32 epilogue's rounding of the exact float64 result."""
    M, K, N = 37, 203, 45                                    # not tile multiples
    lin, x = _linear(rng, N, K), _acts(rng, M, K)
    r = get_recipe("w8a8-int8")
    q = QuantLinear.from_linear(lin, r.weight, r.act)
    y = q(x)
    assert q.last_path == "int8-intmm"

    xn, wn = x.numpy(), lin.weight.detach().numpy()
    sa = (np.abs(xn).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    sw = (np.abs(wn).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    qa = np.clip(np.rint(xn / sa), -127, 127).astype(np.int64)
    qw = np.clip(np.rint(wn / sw), -127, 127).astype(np.int64)
    codes, _, _ = q.quantize_input(x)
    assert np.array_equal(codes.numpy().astype(np.int64), qa)
    assert np.array_equal(q.weight_q.codes.numpy().astype(np.int64), qw)

    acc = qa @ qw.T                                          # exact int64
    prod = acc.astype(np.float64) * sa.astype(np.float64) * sw.T.astype(np.float64)
    ref = prod + lin.bias.detach().numpy().astype(np.float64)
    # float32(acc) (exact below 2^24, else one rounding), times s_a, times s_w, plus bias: three
    # relative roundings of |prod| and one of |y|: |y - ref| <= 3u(1+u)|prod| + u|y|, bounded by:
    tol = 4 * U32 * (np.abs(prod) + np.abs(ref))
    err = np.abs(y.detach().numpy().astype(np.float64) - ref)
    assert (err <= tol).all(), f"max excess {(err - tol).max():.3e}"


def test_int8_path_matches_lowbit_reference(rng):
    """Same layer against lowbit.ops.reference.qlinear_reference on the layer's own QTensors, batched input."""
    B, T, K, N = 3, 11, 130, 29
    lin, x = _linear(rng, N, K), _acts(rng, B * T, K).reshape(B, T, K)
    r = get_recipe("w8a8-int8-tensor")
    q = QuantLinear.from_linear(lin, r.weight, r.act)
    y = q(x).double().reshape(B * T, N)
    xq = quantize(x.reshape(-1, K), r.act)
    prod = qlinear_reference(xq, q.weight_q)
    ref = prod + lin.bias.detach().double()
    tol = 4 * U32 * (prod.abs() + ref.abs())                  # as derived in the numpy test
    assert ((y - ref).abs() <= tol).all()


def test_fp8_path_matches_torch_float8_cast(rng):
    """W8A8 fp8 e4m3 per token / per channel against a torch-only emulation: x / s cast by
    torch.float8_e4m3fn, s = amax / 448, then a float64 matmul."""
    M, K, N = 19, 96, 33
    lin, x = _linear(rng, N, K, bias=False), _acts(rng, M, K)
    r = get_recipe("w8a8-fp8")
    q = QuantLinear.from_linear(lin, r.weight, r.act)
    y = q(x).double()

    def fake(t):
        s = t.abs().amax(dim=1, keepdim=True) / 448.0
        return ((t / s).to(torch.float8_e4m3fn).to(torch.float64)) * s.double()
    xd, wd = fake(x), fake(lin.weight.detach())
    ref = xd @ wd.T
    # Dequantized operands are float32 products decoded*s (one rounding each, u relative) and the
    # float32 matmul rounds each partial sum: |y - ref| <= (K + 2) u * sum_k |x_k||w_k|.
    tol = (K + 2) * U32 * (xd.abs() @ wd.abs().T)
    assert ((y - ref).abs() <= tol).all()


@pytest.mark.parametrize("recipe", ["w4a16", "w4a16-asym", "w4a16-g32", "w8a16-int8", "mxfp8", "mxfp4", "nvfp4"])
def test_dequantized_paths_match_reference(rng, recipe):
    """Every other recipe (K not a multiple of the group: short last group) against the float64
    reference on the same quantized operands."""
    M, K, N = 9, 208, 24                                      # 208 = 6.5 groups of 32
    lin, x = _linear(rng, N, K), _acts(rng, M, K)
    r = get_recipe(recipe)
    q = QuantLinear.from_linear(lin, r.weight, r.act, pad=True)
    y = q(x).double()
    assert q.last_path == "dequantized"
    Kp = q.weight_q.codes.shape[1]                            # padded width (a multiple of the group)
    zp = q.weight_q.expanded_zero_point()
    pad_vals = q.weight_q.decoded()[:, K:] - (0 if zp is None else zp[:, K:])
    assert Kp >= K and float(pad_vals.abs().sum()) == 0      # padding decodes to exact zeros
    xin = torch.nn.functional.pad(x, (0, Kp - K))            # zero columns add nothing to the dot
    xq = xin if r.act is None else quantize(xin, r.act)
    bias = lin.bias.detach().double()
    ref = qlinear_reference(xq, q.weight_q, bias)
    # decoded*s in float32 (one rounding per operand element) then a float32 matmul of K terms and
    # a bias add: |y - ref| <= (K + 2) u sum|x||w| + u |ref|.
    tol = (Kp + 2) * U32 * sum_abs_products(xq, q.weight_q) + U32 * ref.abs()
    assert ((y - ref).abs() <= tol).all()
    # the quantization is not the identity: the layer differs from the float one
    assert not torch.allclose(y, lin(x).double(), rtol=0, atol=0)


def test_static_scale_and_clipping(rng):
    """A static per-tensor int8 scale: codes as numpy computes them with that fixed scale, and
    the clipping statistics count exactly the inputs beyond s * 127."""
    K, N = 64, 16
    lin = _linear(rng, N, K)
    calib = torch.randn(50, K, generator=rng)
    amax = float(calib.abs().max())
    r = get_recipe("w8a8-int8")
    s = scale_from_absmax(amax, static_scheme(r.act))
    assert np.isclose(float(s), np.float32(amax) / np.float32(127), rtol=0, atol=0)
    q = QuantLinear.from_linear(lin, r.weight, static_scheme(r.act), act_static_scale=s)
    new = torch.randn(20, K, generator=rng) * 2.0            # "new text": wider than calibration
    codes, _, _ = quantize_static(new, static_scheme(r.act), s)
    expect = np.clip(np.rint(new.numpy() / np.float32(s)), -127, 127)
    assert np.array_equal(codes.numpy(), expect.astype(np.int8))

    model = torch.nn.Sequential(q)
    rows = clipping_report(model, [new])
    clipped = int((new.abs() / (float(s) * 127) > 1).sum())
    assert clipped > 0
    assert rows[0]["clip_rate"] == clipped / new.numel()
    assert np.isclose(rows[0]["max_ratio"], float(new.abs().max()) / (float(s) * 127), rtol=1e-6)


def test_bad_inputs(rng):
    r = get_recipe("w8a8-int8")
    lin = _linear(rng, 8, 32)
    with torch.no_grad():
        lin.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        QuantLinear.from_linear(lin, r.weight, r.act)
    good = QuantLinear.from_linear(_linear(rng, 8, 32), r.weight, r.act)
    with pytest.raises(ValueError, match="in_features=32"):
        good(torch.randn(2, 31, generator=rng))
    with pytest.raises(ValueError, match="dynamic=False"):
        QuantLinear.from_linear(_linear(rng, 8, 32), r.weight, static_scheme(r.act))
    with pytest.raises(ValueError, match="per-tensor"):
        QuantLinear.from_linear(_linear(rng, 8, 32), r.weight, r.act, act_static_scale=torch.tensor(0.1))
    with pytest.raises(ValueError, match="recipe="):
        get_recipe("w3a3-int3")
    with pytest.raises(TypeError, match="nn.Linear"):
        QuantLinear.from_linear(torch.nn.Conv1d(2, 2, 1), r.weight, r.act)


def test_zero_rows_do_not_divide_by_zero(rng):
    """Padding tokens (all-zero rows) next to real ones: finite output, and zero rows give the bias."""
    lin, x = _linear(rng, 12, 40), _acts(rng, 6, 40)
    x[2] = 0.0
    r = get_recipe("w8a8-int8")
    y = QuantLinear.from_linear(lin, r.weight, r.act)(x)
    assert torch.isfinite(y).all()
    assert torch.equal(y[2], lin.bias.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel path needs CUDA")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8"])
def test_cuda_kernel_path_matches_reference(rng, recipe):
    """On CUDA the layer runs lowbit.ops.linear (Triton); its float32 output against the float64
    reference on the same QTensors."""
    M, K, N = 33, 320, 72
    lin, x = _linear(rng, N, K), _acts(rng, M, K)
    r = get_recipe(recipe)
    q = QuantLinear.from_linear(lin, r.weight, r.act).cuda()
    y = q(x.cuda()).double().cpu()
    assert q.last_path == "fast:w8a8"       # float32 in: the prepared path, float32 out
    xq = quantize(x, r.act)
    prod = qlinear_reference(xq, q.weight_q)
    ref = prod + lin.bias.detach().double()
    # int8: exact int32 accumulator, float32 epilogue (as derived above). fp8: Hopper's fp8 MMA aligns
    # the products of one instruction to the largest exponent and keeps ~13 bits (DeepSeek-V3 report,
    # sec. 3.3.2: "around 14 bits"), so each of the K products may lose up to 2^-12 of the largest
    # product's magnitude; then float32 accumulation: |err| <= K 2^-12 max_k|x_k w_k| + K u sum|x||w|.
    if recipe == "w8a8-int8":
        acc = 0
    else:
        xd, wd = xq.dequantize(torch.float64).abs(), q.weight_q.dequantize(torch.float64).abs()
        pmax = (xd[:, None, :] * wd[None, :, :]).amax(dim=-1)
        acc = K * 2.0 ** -12 * pmax + K * U32 * sum_abs_products(xq, q.weight_q)
    tol = acc + 4 * U32 * (prod.abs() + ref.abs())
    assert ((y - ref).abs() <= tol).all()
