"""Bug zoo: correct kernels (emulated in torch the way a GPU kernel computes) pass check_linear;
planted bugs fail AND are named. Fresh random inputs in every test (rng fixture)."""
import pytest
import torch

import lowbit as lb
from lowbit.packing import pack_scales, unpack_scales
from lowbit.quantize import e8m0_to_scale
from lowbit.verify import check_linear

INT8_TOKEN = lb.QuantScheme(format="int8", strategy="token")
INT8_CHANNEL = lb.QuantScheme(format="int8", strategy="channel")
INT8_TENSOR = lb.QuantScheme(format="int8", strategy="tensor")
UINT8_ASYM = lb.QuantScheme(format="uint8", strategy="token", symmetric=False)


def _inputs(rng, M, K, N, nonneg=False):
    x = torch.rand(M, K, generator=rng) if nonneg else torch.randn(M, K, generator=rng)
    # per-channel gains spanning ~30x, as real weight matrices have
    gains = torch.exp(torch.rand(N, 1, generator=rng) * 3.4)
    return x, torch.randn(N, K, generator=rng) * gains


def int8_kernel(xq, wq, *, zero_point_term=True, w_scale=None):
    """W8A8 kernel: exact integer accumulation (int64 here, int32 on a GPU), zero-point
    correction with the weight code column sums, float32 epilogue acc * s_x * s_w."""
    qx = xq.codes.to(torch.int64)
    qw = wq.codes.to(torch.int64)
    acc = qx @ qw.T
    assert acc.abs().max() < 2 ** 31
    if xq.zero_point is not None and zero_point_term:
        acc = acc - xq.zero_point.to(torch.int64) * qw.sum(dim=1)[None, :]
    sw = wq.scale.reshape(1, -1) if w_scale is None else w_scale
    return (acc.to(torch.float32) * xq.scale) * sw


def mx_kernel(xq, wq, *, w_scale=None, hoist=False, partial_dtype=torch.float32):
    """MXFP8 kernel: per 32-block, products of decoded fp8 elements summed in fp32 (exact products),
    the block sum times the two e8m0 scales, accumulated across blocks in `partial_dtype`."""
    dx, dw = xq.decoded(), wq.decoded()
    sx, sw = xq.scale, (wq.scale if w_scale is None else w_scale)
    G = sx.shape[1]
    acc = torch.zeros(dx.shape[0], dw.shape[0], dtype=partial_dtype)
    for j in range(G):
        part = dx[:, 32 * j:32 * j + 32] @ dw[:, 32 * j:32 * j + 32].T
        jj = G - 1 if hoist else j   # the hoisting bug: one block's scale for all blocks
        acc = acc + (part * sx[:, jj:jj + 1] * sw[:, jj][None, :]).to(partial_dtype)
    return acc.to(torch.float32)


def _names(v):
    return [c.name for c in v.causes]


# ---------------------------------------------------------------- correct kernels pass
@pytest.mark.parametrize("M,K,N", [(1, 64, 7), (17, 96, 33), (40, 257, 19)])
def test_w8a8_token_channel_passes(rng, M, K, N):
    x, w = _inputs(rng, M, K, N)
    out = int8_kernel(lb.quantize(x, INT8_TOKEN), lb.quantize(w, INT8_CHANNEL))
    v = check_linear(out, x, w, x_scheme=INT8_TOKEN, w_scheme=INT8_CHANNEL)
    assert v.passed, v.report()
    assert v.kind == "ok" and v.first_failure is None


@pytest.mark.parametrize("M,K,N", [(3, 64, 5), (23, 130, 31)])
def test_asymmetric_activations_with_zero_point_pass(rng, M, K, N):
    x, w = _inputs(rng, M, K, N, nonneg=True)
    x = x - 0.2  # one-sided but not all positive: a non-trivial zero point
    xq, wq = lb.quantize(x, UINT8_ASYM), lb.quantize(w, INT8_CHANNEL)
    assert (xq.zero_point != 0).any()
    v = check_linear(int8_kernel(xq, wq), x, w, x_scheme=UINT8_ASYM, w_scheme=INT8_CHANNEL)
    assert v.passed, v.report()


@pytest.mark.parametrize("M,K,N", [(5, 96, 13), (19, 256, 31)])
def test_mxfp8_fp32_block_accumulation_passes(rng, M, K, N):
    mx = lb.get_preset("mxfp8")
    x, w = _inputs(rng, M, K, N)
    out = mx_kernel(lb.quantize(x, mx), lb.quantize(w, mx))
    v = check_linear(out, x, w, x_scheme=mx, w_scheme=mx)
    assert v.passed, v.report()


# ---------------------------------------------------------------- planted bugs fail, named
def test_silent_per_tensor_fallback_is_named(rng):
    x, w = _inputs(rng, 21, 128, 27)
    out = int8_kernel(lb.quantize(x, INT8_TOKEN), lb.quantize(w, INT8_TENSOR))
    v = check_linear(out, x, w, x_scheme=INT8_TOKEN, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic"
    assert "silent_per_tensor_fallback" in _names(v), v.report()


def test_weight_scales_on_wrong_axis_are_named(rng):
    x, w = _inputs(rng, 12, 96, 20)
    xq, wq = lb.quantize(x, INT8_TOKEN), lb.quantize(w, INT8_CHANNEL)
    out = int8_kernel(xq, wq, w_scale=wq.scale[:12].reshape(-1, 1))  # s_w[row] instead of s_w[col]
    v = check_linear(out, x, w, x_scheme=INT8_TOKEN, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic"
    assert "scales_on_wrong_axis" in _names(v), v.report()


def test_output_shifted_one_row_is_named(rng):
    x, w = _inputs(rng, 15, 80, 9)
    good = int8_kernel(lb.quantize(x, INT8_TOKEN), lb.quantize(w, INT8_CHANNEL))
    out = torch.cat([good[:1], good[:-1]])  # row i written from row i-1
    v = check_linear(out, x, w, x_scheme=INT8_TOKEN, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic" and v.first_failure[0] == 1
    assert "row_shift" in _names(v), v.report()


def test_int8_wrap_from_stale_scale_is_named(rng):
    x, w = _inputs(rng, 16, 64, 24)
    # a static scale calibrated earlier (2% headroom), then a token arrives with one value 5% over
    # the calibrated range: it rounds to +-133, which an int8 store without a clamp wraps by 256
    s = x.abs().max() * 1.02 / 127
    r, k = int(torch.randint(16, (1,), generator=rng)), int(torch.randint(64, (1,), generator=rng))
    x[r, k] = (1 if torch.rand(1, generator=rng) < 0.5 else -1) * 1.05 * 127 * s
    q = torch.round(x / s)
    assert q.abs().max() > 128 and (q.abs() > 127).sum() == 1
    wrapped = ((q.to(torch.int64) + 128) % 256 - 128)
    wq = lb.quantize(w, INT8_CHANNEL)
    out = (wrapped @ wq.codes.to(torch.int64).T).to(torch.float32) * s * wq.scale.reshape(1, -1)
    v = check_linear(out, x, w, x_scheme=INT8_TENSOR, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic"
    assert v.causes[0].name == "codes_wrapped_not_clamped" and v.causes[0].confirmed, v.report()
    assert f"rows of x [{r}]" in v.report() or f"rows [{r}]" in v.report(), v.report()


def test_missing_zero_point_term_is_named(rng):
    x, w = _inputs(rng, 11, 72, 17, nonneg=True)
    x = x - 0.3  # ReLU-like but shifted: min(x, 0) < 0, so the zero point is not 0
    xq, wq = lb.quantize(x, UINT8_ASYM), lb.quantize(w, INT8_CHANNEL)
    assert (xq.zero_point != 0).all()
    out = int8_kernel(xq, wq, zero_point_term=False)
    v = check_linear(out, x, w, x_scheme=UINT8_ASYM, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic"
    assert "missing_zero_point_term" in _names(v), v.report()


def test_mx_scale_hoisted_out_of_k_loop_is_named(rng):
    mx = lb.get_preset("mxfp8")
    x, w = _inputs(rng, 9, 160, 14)
    out = mx_kernel(lb.quantize(x, mx), lb.quantize(w, mx), hoist=True)
    v = check_linear(out, x, w, x_scheme=mx, w_scheme=mx)
    assert not v.passed and v.kind == "logic"
    assert "scale_hoisted_out_of_k_loop" in _names(v), v.report()


def _misread_w_scales(wq, how):
    codes = wq.scale_codes
    words = pack_scales(codes, layout="group_major")              # uint32 [G/4, N]
    if how == "byte_order":
        w64 = words.to(torch.int64)
        w64 = ((w64 & 0xFF) << 24) | (((w64 >> 8) & 0xFF) << 16) | (((w64 >> 16) & 0xFF) << 8) | (w64 >> 24)
        read = unpack_scales(w64.to(torch.uint32), "group_major", *codes.shape)
    else:  # a row-major reader: word (row, g) at flat index row * G4 + g
        R, G = codes.shape
        flat = words.reshape(-1)
        read = unpack_scales(flat.reshape(R, G // 4).t().contiguous(), "group_major", R, G)
    return e8m0_to_scale(read).T  # [G, N] -> used as sw[:, j] below via transpose back


@pytest.mark.parametrize("how,name", [("byte_order", "mx_scale_byte_order"),
                                      ("row_major", "scale_words_group_major_read_row_major")])
def test_mx_scale_layout_bugs_are_named(rng, how, name):
    mx = lb.get_preset("mxfp8")
    x, w = _inputs(rng, 7, 256, 10)   # 8 scales per row: two uint32 word groups
    xq, wq = lb.quantize(x, mx), lb.quantize(w, mx)
    # different blocks must have different scales, or no layout bug is visible
    w = w * torch.exp2(torch.randint(-3, 4, (1, 8), generator=rng).float()).repeat_interleave(32, dim=1)
    wq = lb.quantize(w, mx)
    out = mx_kernel(xq, wq, w_scale=_misread_w_scales(wq, how).T)
    v = check_linear(out, x, w, x_scheme=mx, w_scheme=mx)
    assert not v.passed and v.kind == "logic"
    assert name in _names(v), v.report()


def test_fp16_accumulation_of_mx_partials_is_named(rng):
    mx = lb.get_preset("mxfp8")
    x, w = _inputs(rng, 24, 256, 20)
    out = mx_kernel(lb.quantize(x, mx), lb.quantize(w, mx), partial_dtype=torch.float16)
    v = check_linear(out, x, w, x_scheme=mx, w_scheme=mx, accumulator="fp32")
    assert not v.passed and v.kind == "numerical"
    assert "accumulator_narrower_than_promised" in _names(v), v.report()
    # the same output is fine when the kernel honestly declares an fp16 accumulator
    assert check_linear(out, x, w, x_scheme=mx, w_scheme=mx, accumulator="fp16").passed


def test_one_column_off_by_a_small_factor_is_not_blamed_on_the_accumulator(rng):
    # A 1% error on one output column can fit an fp16 accumulator's bound, but a narrow
    # accumulator would spread its error over the whole output: the diagnosis must point at
    # the column, never at the accumulator.
    x, w = _inputs(rng, 33, 256, 41)
    xq, wq = lb.quantize(x, INT8_TOKEN), lb.quantize(w, INT8_CHANNEL)
    out = int8_kernel(xq, wq)
    col = int(torch.randint(0, 41, (1,), generator=rng))
    out[:, col] *= 1.01
    v = check_linear(out, x, w, x_scheme=INT8_TOKEN, w_scheme=INT8_CHANNEL)
    assert not v.passed and v.kind == "logic"
    assert "error_in_few_columns" in _names(v), v.report()
    assert "accumulator_narrower_than_promised" not in _names(v), v.report()
