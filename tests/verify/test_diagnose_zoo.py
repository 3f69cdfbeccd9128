"""Bug zoo: each kernel bug planted in a CPU kernel (float32 arithmetic, the way a GPU kernel
computes) at odd shapes; check_linear must name it FIRST, and give no other bug's name as
confirmed. Correct kernels, including honestly declared narrow accumulators, must pass.

The planted kernels build their mistakes with their own code (ml_dtypes for fp8 decoding, bit
operations for nibbles and e8m0), never with the diagnosis' simulations. Real bug reports behind
the hypotheses:
- stride-0 / one scale for all rows: cuBLAS's rowwise fp8 case on the H200; pytorch/ao#2253
- scale direction / applied twice: meta-pytorch/tritonbench#1145
- wrong scale group size, transposed square scale grid: pytorch/pytorch#195751, vllm-project/vllm#54521
- K tail dropped: NVIDIA/cutlass#3536, tile-ai/tilelang#2605, NVIDIA/TensorRT-LLM#12835
- nibble layout: kekzl/imp#722, amd/Quark#30; unsigned nibbles read as signed: ROCm/hip-ep#178
- e4m3fn vs e4m3fnuz bytes: uccl-project/uccl#804
- bias added before dequantization: vllm-project/vllm#31676
- fp8 fast accumulation: NVIDIA/cutlass#1329, deepseek-ai/DeepSeek-V3#750
"""
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.packing import pack_int4
from lowbit.verify import check_linear
from accumulator_fixtures import hopper_fp8_mma

I8T = lb.QuantScheme(format="int8", strategy="token")
I8C = lb.QuantScheme(format="int8", strategy="channel")
I8TEN = lb.QuantScheme(format="int8", strategy="tensor")
U8A = lb.QuantScheme(format="uint8", strategy="token", symmetric=False)
U4G = lb.QuantScheme(format="uint4", strategy="group", group_size=32, symmetric=False)
I4G = lb.get_preset("int4_g128")
FP8R = lb.get_preset("fp8_row")
MXFP8, MXFP4 = lb.get_preset("mxfp8"), lb.get_preset("mxfp4")
B1X128, B128 = lb.get_preset("fp8_block1x128"), lb.get_preset("fp8_block128")


def inputs(rng, M, K, N, *, nonneg=False, floor=0.0):
    x = torch.rand(M, K, generator=rng) if nonneg else torch.randn(M, K, generator=rng)
    gains = torch.exp(torch.rand(N, 1, generator=rng) * 3.4)   # channels ~30x apart
    w = torch.randn(N, K, generator=rng)
    if floor:   # keep every weight away from 0 (codes that round to -0 decode as NaN in fnuz)
        w = torch.where(w.abs() < floor, floor * torch.sign(w + 1e-30), w)
    return x, w * gains


def elements(q):
    """Decoded elements (zero point subtracted) float32 [R, K] and per-k scales float32 [R, K]."""
    if q.scheme.type == "int":
        e = q.codes.to(torch.float32)
        if q.zero_point is not None:
            e = e - q.expanded_zero_point().float()
    else:
        e = q.decoded()
    return e, q.expanded_scale().float()


def gemm(X, W, SX, SW, *, group, integer=False, bias=None, tiles=None, acc_dtype=torch.float32):
    """A tiled kernel: per K-block of `group` (scales constant inside), the block's dot products
    (exact int64 for integer codes, float32 otherwise) times both scales in float32, summed
    across blocks in acc_dtype; + bias in float32. tiles: the K ranges the main loop visits."""
    M, K = X.shape
    ranges = tiles if tiles is not None else [(a, min(a + group, K)) for a in range(0, K, group)]
    acc = torch.zeros(M, W.shape[0], dtype=acc_dtype)
    for a, b in ranges:
        if integer:
            part = (X[:, a:b].to(torch.int64) @ W[:, a:b].to(torch.int64).T).to(torch.float32)
        else:
            part = X[:, a:b] @ W[:, a:b].T
        acc = (acc + (part * SX[:, a:a + 1]) * SW[:, a][None, :]).to(acc_dtype)
    out = acc.to(torch.float32)
    return out if bias is None else out + bias


def run(xq, wq, **kw):
    X, SX = elements(xq) if hasattr(xq, "codes") else (xq, torch.ones_like(xq))
    W, SW = elements(wq) if hasattr(wq, "codes") else (wq, torch.ones_like(wq))
    group = kw.pop("group", None) or _group(xq, wq)
    integer = kw.pop("integer", all(hasattr(q, "codes") and q.scheme.type == "int" for q in (xq, wq)))
    return gemm(kw.pop("X", X), kw.pop("W", W), kw.pop("SX", SX), kw.pop("SW", SW), group=group,
                integer=integer, **kw)


def _group(xq, wq):
    import math
    gs = [q.codes.shape[1] // q.scale.shape[1] for q in (xq, wq) if hasattr(q, "codes")]
    K = (xq.codes if hasattr(xq, "codes") else xq).shape[1]
    g = K
    for v in gs:
        g = math.gcd(g, v)
    return g


def fnuz(codes):
    """Decode e4m3fn bytes as e4m3fnuz with ml_dtypes (the independent oracle)."""
    return torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e4m3fnuz).astype(np.float32))


def e5m2(codes):
    return torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e5m2).astype(np.float32))


# ------------------------------------------------------------------------- planted bugs
# Each returns (out, x, w, x_scheme, w_scheme, bias); the bug's name is the table key.
def b_scale_missing(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq, SW=torch.ones(N, K)), x, w, FP8R, FP8R, None


def b_scale_applied_twice(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    X, SX = elements(xq)
    return run(xq, wq, SX=SX * SX), x, w, I8T, I8C, None


def b_zero_block_scale_nan(rng, M, K, N):
    # an all-zero activation row quantized with the scale 0: 0/0 = NaN codes, a NaN output row
    # (pytorch/ao#4713: torchao 0.18's Float8Tensor; `lowbit audit` shows it in
    # benchmarks/results/audit_cpu_torchao.txt)
    x, w = inputs(rng, M, K, N)
    x[M // 2] = 0.0
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    out = run(xq, wq)
    out[M // 2] = float("nan")
    return out, x, w, FP8R, FP8R, None


def b_scale_inverted(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    W, SW = elements(wq)
    return run(xq, wq, SW=1.0 / SW), x, w, I8T, I8C, None


def b_scale_broadcast_stride0(rng, M, K, N):
    # the H200 case: rowwise fp8 with the activation scale pointer read with stride 0
    x, w = inputs(rng, M, K, N)
    x = x * torch.exp(torch.randn(M, 1, generator=rng))        # tokens of different sizes
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    X, SX = elements(xq)
    return run(xq, wq, SX=SX[:1].expand(M, K)), x, w, FP8R, FP8R, None


def b_other_sides_scale(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8TEN), lb.quantize(w, I8TEN)
    X, SX = elements(xq)
    return run(xq, wq, SW=SX[:1, :1].expand(N, K)), x, w, I8TEN, I8TEN, None


def b_wrong_group_size(rng, M, K, N):
    # int4 g128 weights whose kernel reads scale index k // 64 from the row-major [N, G] scales
    K = 384
    x, w = inputs(rng, M, K, N)
    w = w * torch.exp2(torch.randint(-2, 3, (N, 3), generator=rng).float()).repeat_interleave(128, dim=1)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I4G)
    flat = wq.scale.reshape(-1)
    idx = torch.arange(N)[:, None] * 3 + torch.arange(K)[None, :] // 64
    SW = torch.where(idx < flat.numel(), flat[idx.clamp(max=flat.numel() - 1)], torch.full((), 7.0))
    return run(xq, wq, SW=SW, group=64), x, w, I8T, I4G, None


def b_e8m0_exponent_off_by_one(rng, M, K, N):
    K = 32 * (K // 32) + 32
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, MXFP8), lb.quantize(w, MXFP4)
    codes = wq.scale_codes.to(torch.int64)
    SW = torch.exp2((codes - 128).double()).float().repeat_interleave(32, dim=1)   # bias 128, not 127
    return run(xq, wq, SW=SW), x, w, MXFP8, MXFP4, None


def b_fp8_format_confusion(rng, M, K, N):
    x, w = inputs(rng, M, K, N, floor=0.05)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq, W=fnuz(wq.codes)), x, w, FP8R, FP8R, None


def b_fp8_format_confusion_e5m2(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq, X=e5m2(xq.codes)), x, w, FP8R, FP8R, None


def b_codes_wrong_signedness(rng, M, K, N):
    K = 32 * (K // 32) + 32
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, U4G)
    c = wq.codes.to(torch.float32)
    W = torch.where(c >= 8, c - 16, c) - wq.expanded_zero_point().float()
    return run(xq, wq, W=W), x, w, I8T, U4G, None


def b_nibble_order_swapped(rng, M, K, N):
    K = 128 * (K // 128) + 128
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I4G)
    packed = pack_int4(wq.codes)                                  # low nibble = even k
    s = packed.view(torch.int8)
    hi, lo = s >> 4, (s << 4) >> 4
    W = torch.stack((hi, lo), dim=-1).reshape(N, K).float()       # the kernel takes the high nibble first
    return run(xq, wq, W=W), x, w, I8T, I4G, None


def b_zero_point_wrong_sign(rng, M, K, N):
    x, w = inputs(rng, M, K, N, nonneg=True)
    x = x - 0.3
    xq, wq = lb.quantize(x, U8A), lb.quantize(w, I8C)
    X = xq.codes.to(torch.float32) + xq.expanded_zero_point().float()
    return run(xq, wq, X=X), x, w, U8A, I8C, None


def b_missing_zero_point_term(rng, M, K, N):
    x, w = inputs(rng, M, K, N, nonneg=True)
    x = x - 0.3
    xq, wq = lb.quantize(x, U8A), lb.quantize(w, I8C)
    return run(xq, wq, X=xq.codes.to(torch.float32)), x, w, U8A, I8C, None


def _tiles(K, t):
    return [(a, a + t) for a in range(0, K - t + 1, t)]


def b_k_tail_dropped(rng, M, K, N):
    K = 32 * (K // 32) + 13
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq, tiles=_tiles(K, 32)), x, w, FP8R, FP8R, None


def b_k_tile_read_twice(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    return run(xq, wq, tiles=[(0, 64), (0, K)]), x, w, I8T, I8C, None


def b_k_tile_dropped(rng, M, K, N):
    # split-K into 2 slices, the second slice's partial never added
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq, tiles=[(0, -(-K // 2))]), x, w, FP8R, FP8R, None


def b_weight_read_transposed(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8TEN)
    W = wq.codes.reshape(-1)[(torch.arange(K)[None, :] * N + torch.arange(N)[:, None])].float()
    return run(xq, wq, W=W), x, w, I8T, I8TEN, None


def _biased(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    b = torch.randn(N, generator=rng) * 4
    return x, w, b, lb.quantize(x, I8T), lb.quantize(w, I8C)


def b_bias_missing(rng, M, K, N):
    x, w, b, xq, wq = _biased(rng, M, K, N)
    return run(xq, wq), x, w, I8T, I8C, b


def b_bias_added_twice(rng, M, K, N):
    x, w, b, xq, wq = _biased(rng, M, K, N)
    return run(xq, wq, bias=2 * b), x, w, I8T, I8C, b


def b_bias_before_scales(rng, M, K, N):
    x, w, b, xq, wq = _biased(rng, M, K, N)
    X, SX = elements(xq)
    W, SW = elements(wq)
    acc = (X.to(torch.int64) @ W.to(torch.int64).T).float() + b    # bias into the integer accumulator
    return (acc * SX[:, :1]) * SW[:, 0][None, :], x, w, I8T, I8C, b


def b_output_clamped(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    x = x * 3000.0                                                 # outputs around the fp16 limit
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    return run(xq, wq).clamp(-65504.0, 65504.0), x, w, FP8R, FP8R, None


def b_rows_permuted(rng, M, K, N):
    # a grouped-launch swizzle undone wrongly on the store: rows reversed inside each 8-row tile
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    good = run(xq, wq)
    p = torch.arange(M)
    full = (M // 8) * 8
    p[:full] = (p[:full] // 8) * 8 + 7 - p[:full] % 8
    return good[p], x, w, I8T, I8C, None


def b_columns_permuted(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    good = run(xq, wq)
    p = torch.arange(N)
    p[: (N // 2) * 2] = p[: (N // 2) * 2] ^ 1                      # neighbouring columns swapped
    return good[:, p], x, w, FP8R, FP8R, None


def b_scale_grid_transposed(rng, M, K, N):
    K = N = 256                                                    # 2 x 2 grid of 128 x 128 blocks
    x, w = inputs(rng, M, K, N)
    w = w * torch.exp2(torch.randint(-3, 4, (2, 2), generator=rng).float()).repeat_interleave(128, 0) \
        .repeat_interleave(128, 1)
    xq, wq = lb.quantize(x, B1X128), lb.quantize(w, B128)
    SW = wq.scale.T.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return run(xq, wq, SW=SW), x, w, B1X128, B128, None


def b_scale_hoisted_out_of_k_loop(rng, M, K, N):
    K = 32 * (K // 32) + 64
    x, w = inputs(rng, M, K, N)
    w = w * torch.exp2(torch.randint(-3, 4, (1, K // 32), generator=rng).float()).repeat_interleave(32, 1)
    xq, wq = lb.quantize(x, MXFP8), lb.quantize(w, MXFP8)
    W, SW = elements(wq)
    return run(xq, wq, SW=SW[:, :1].expand(N, K)), x, w, MXFP8, MXFP8, None


def b_silent_per_tensor_fallback(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    return run(lb.quantize(x, I8T), lb.quantize(w, I8TEN)), x, w, I8T, I8C, None


def b_different_quantization(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    return x @ w.T, x, w, I8T, I8C, None


def b_scales_rounded(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    W, SW = elements(wq)
    return run(xq, wq, SW=SW.to(torch.bfloat16).float()), x, w, I8T, I8C, None


def b_scale_replaced_by_constant(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    x = x * torch.exp(torch.randn(M, 1, generator=rng))
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    s_tensor = 1.5 * x.abs().max() / 448.0     # a static per-tensor scale with headroom: no row's own
    return run(xq, wq, SX=torch.full((M, K), float(s_tensor))), x, w, FP8R, FP8R, None


ZOO = {name[2:]: fn for name, fn in globals().items() if name.startswith("b_")}
ZOO_NAME = {k: ("fp8_format_confusion" if k.startswith("fp8_format_confusion") else k) for k in ZOO}
ROW_BUGS = {"rows_permuted", "scale_broadcast_stride0"}   # invisible with one row
# with one row, a per-row scale replaced by another value is one wrong factor on every output
ONE_ROW_NAME = {"scale_replaced_by_constant": "output_off_by_constant_factor"}
SHAPES = [(13, 200, 21), (1, 300, 17), (37, 259, 10)]


@pytest.mark.parametrize("bug", sorted(ZOO))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_planted_bug_is_named_first_and_no_other_name_is_confirmed(rng, bug, shape):
    out, x, w, xs, ws, b = ZOO[bug](rng, *shape)
    v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws, bias=b)
    if bug in ROW_BUGS and shape[0] == 1:   # with one row these are not bugs: the output is right
        assert v.passed, v.report()
        return
    name = ONE_ROW_NAME.get(bug, ZOO_NAME[bug]) if shape[0] == 1 else ZOO_NAME[bug]
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == name and v.causes[0].confirmed, v.report()
    wrong = [c.name for c in v.causes if c.confirmed and c.name != name]
    assert not wrong, v.report()


# ------------------------------------------------------------------------- correct kernels
CORRECT = {
    "w8a8 token/channel": (I8T, I8C), "uint8 asym x int8": (U8A, I8C), "w4a8 int4 g128": (I8T, I4G),
    "fp8 rowwise": (FP8R, FP8R), "mxfp8": (MXFP8, MXFP8), "mxfp8 x mxfp4": (MXFP8, MXFP4),
    "nvfp4": (lb.get_preset("nvfp4"), lb.get_preset("nvfp4")), "fp8 blockwise": (B1X128, B128),
    "unquantized": (None, None),
}


@pytest.mark.parametrize("case", sorted(CORRECT))
@pytest.mark.parametrize("shape", [(1, 256, 9), (19, 384, 33)], ids=lambda s: "x".join(map(str, s)))
def test_correct_kernels_pass(rng, case, shape):
    M, K, N = shape
    xs, ws = CORRECT[case]
    x, w = inputs(rng, M, K, N, nonneg=xs is U8A)
    b = torch.randn(N, generator=rng)
    xq = lb.quantize(x, xs) if xs else x
    wq = lb.quantize(w, ws) if ws else w
    out = run(xq, wq, bias=b)
    v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws, bias=b)
    assert v.passed and v.kind == "ok", v.report()


def _acc_kernel(X, W, chunk, rnd):
    """Dot products summed `chunk` products at a time (exact float64 chunk sums), the running sum
    rounded by `rnd` after every chunk: a narrow accumulator in an order the diagnosis does not
    simulate (chunks of 8 / 32)."""
    acc = torch.zeros(X.shape[0], W.shape[0], dtype=torch.float64)
    for a in range(0, X.shape[1], chunk):
        acc = rnd(acc + X[:, a:a + chunk].double() @ W[:, a:a + chunk].double().T)
    return acc


def _fp16(t):
    return t.to(torch.float16).double()


def _trunc14(t):
    """Keep 13 explicit mantissa bits of float32, truncating (ml_dtypes-free bit masking in numpy)."""
    a = t.to(torch.float32).numpy().view(np.int32) & np.int32(-(1 << 10))
    return torch.from_numpy(a.view(np.float32)).double()


@pytest.mark.parametrize("shape", [(24, 512, 20), (5, 1000, 31)], ids=lambda s: "x".join(map(str, s)))
def test_fp16_accumulation_in_an_unsimulated_order_is_numerical_not_logic(rng, shape):
    M, K, N = shape
    x, w = inputs(rng, M, K, N)
    out = _acc_kernel(x, w, 8, _fp16).float()
    v = check_linear(out, x, w, accumulator="fp32")
    assert not v.passed and v.kind == "numerical", v.report()
    assert v.causes[0].name == "accumulator_narrower_than_promised" and "fp16" in v.causes[0].detail, v.report()
    assert check_linear(out, x, w, accumulator="fp16").passed       # honestly declared: fine


def test_fp8_fast_accumulation_is_named_and_passes_when_declared(rng):
    M, K, N = 16, 2048, 24
    x, w = inputs(rng, M, K, N, nonneg=True)                         # same-sign sums: truncation shows
    w = w.abs()
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    X, SX = elements(xq)
    W, SW = elements(wq)
    out = (hopper_fp8_mma(X, W).float() * SX[:, :1]) * SW[:, 0][None, :]
    v = check_linear(out, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert not v.passed and v.kind == "numerical", v.report()
    assert v.causes[0].name == "accumulator_narrower_than_promised" and "fp8_fast" in v.causes[0].detail
    assert v.causes[0].confirmed, v.report()       # the kernel's order is one the diagnosis simulates
    assert check_linear(out, x, w, x_scheme=FP8R, w_scheme=FP8R, accumulator="fp8_fast").passed


@pytest.mark.parametrize("scheme", [FP8R, lb.get_preset("fp8_tensor")], ids=["rowwise", "tensorwise"])
def test_cublas_fp8_at_long_k_same_sign_is_named_an_accumulator_not_a_scale(rng, scheme):
    """cuBLAS fp8 without fast accumulation (promoted every 128 K) on same-sign K = 4096 sums shrinks
    every output by ~1.2e-4: the H200 audit named that `scales_rounded` / `output_off_by_constant_factor`
    (a fitted factor 0.99976). The accumulator must come first."""
    from lowbit.verify import audit as au
    x, w = au._same_sign(rng, 8, 4096, 16)                           # the audit's case
    xq, wq = lb.quantize(x, scheme), lb.quantize(w, scheme)
    X, SX = elements(xq)
    W, SW = elements(wq)
    out = (hopper_fp8_mma(X, W, promote=128).float() * SX[:, :1]) * SW[:, 0][None, :]
    v = check_linear(out, x, w, x_scheme=scheme, w_scheme=scheme)
    assert not v.passed and v.kind == "numerical", v.report()
    assert v.causes[0].name == "accumulator_narrower_than_promised" and "fp8_fast" in v.causes[0].detail, v.report()
    assert check_linear(out, x, w, x_scheme=scheme, w_scheme=scheme, accumulator="fp8_fast").passed


def test_fp8_truncation_in_an_unsimulated_order_is_numerical(rng):
    # the running sum truncated to 14 bits once per 32-wide step (products added exactly): not what
    # Hopper does, so no simulated order reproduces it, but its error has an fp8 accumulator's size
    M, K, N = 16, 2048, 24
    x, w = inputs(rng, M, K, N, nonneg=True)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w.abs(), FP8R)
    X, SX = elements(xq)
    W, SW = elements(wq)
    out = (_acc_kernel(X, W, 32, _trunc14).float() * SX[:, :1]) * SW[:, 0][None, :]
    v = check_linear(out, x, w.abs(), x_scheme=FP8R, w_scheme=FP8R)
    assert not v.passed and v.kind == "numerical", v.report()
    assert v.causes[0].name == "accumulator_narrower_than_promised" and "fp8_fast" in v.causes[0].detail


def test_simulated_fp8_accumulator_reproduces_the_h200(rng):
    """The independent oracle: cuBLAS fp8 GEMMs measured on an H200 (scripts/gpu_fastaccum_probe.py:
    e4m3 codes, unit scales, K = 256 / 1024 / 4096, same-sign and mixed-sign). With fast accumulation
    the simulation reproduces every same-sign output bit for bit at K = 4096 and >= 99% of the mixed
    ones; at smaller K the same-sign sums match in >= 75% of outputs (the rest differ in the last
    bits: an alignment detail at small exponents the model does not have). Without fast accumulation
    (promoted every 128 K) it reproduces every mixed-sign output and the same-sign loss within 15%."""
    from lowbit.verify import accumulate as A
    d = np.load(Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fastaccum_probe_h200.npz")
    fast, precise = A.orders_for("fp8_fast", 1, True)
    dec = lambda k: torch.from_numpy(d[k].view(ml_dtypes.float8_e4m3fn).astype(np.float64))  # noqa: E731
    for K, same_min in ((256, 0.75), (1024, 0.9), (4096, 1.0)):
        for sign in ("same", "mixed"):
            a, b = dec(f"K{K}_{sign}_a"), dec(f"K{K}_{sign}_b")
            rows, cols = torch.arange(a.shape[0]), torch.arange(b.shape[0])
            got = A.simulate(a, b, fast, rows, cols).numpy()
            share = float(np.mean(got == d[f"K{K}_{sign}_fast"]))
            assert share >= (same_min if sign == "same" else 0.99), (K, sign, share)
            got = A.simulate(a, b, precise, rows, cols).numpy()
            ex, hw = d[f"K{K}_{sign}_exact"], d[f"K{K}_{sign}_precise"]
            if sign == "mixed":
                assert np.array_equal(got, hw), (K, "precise")
            else:
                loss_sim, loss_hw = np.median(1 - got / ex), np.median(1 - hw / ex)
                assert abs(loss_sim / loss_hw - 1) < 0.15, (K, loss_sim, loss_hw)


def test_bf16_accumulator_one_product_at_a_time_is_reproduced_exactly(rng):
    x, w = inputs(rng, 9, 300, 14)
    out = _acc_kernel(x, w, 1, lambda t: t.to(torch.bfloat16).double()).float()
    v = check_linear(out, x, w)
    assert v.kind == "numerical" and v.causes[0].name == "accumulator_narrower_than_promised", v.report()
    assert v.causes[0].confirmed and "bf16" in v.causes[0].detail
    assert check_linear(out, x, w, accumulator="bf16").passed


def test_a_bug_outside_the_catalogue_is_unexplained_with_k_block_evidence(rng):
    # one 32-wide K block's partial scaled by 0.5 (no hypothesis simulates a half-counted block)
    M, K, N = 17, 320, 23
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, I8T), lb.quantize(w, I8C)
    X, SX = elements(xq)
    W, SW = elements(wq)
    j = int(torch.randint(1, K // 32 - 1, (1,), generator=rng))
    Xh = X.clone()
    Xh[:, 32 * j:32 * j + 32] *= 0.5
    out = run(xq, wq, X=Xh, integer=False)                          # float path: halved codes are not ints
    v = check_linear(out, x, w, x_scheme=I8T, w_scheme=I8C)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "unexplained_logic_error", v.report()
    assert not [c for c in v.causes if c.confirmed], v.report()
    assert f"K {32 * j}..{32 * j + 31} x0.5" in v.causes[0].detail, v.report()
    _partials_explain_most(v)


def _partials_explain_most(v):
    """Causes after `unexplained_logic_error` are evidence or partial matches explaining >= 80%."""
    import re
    for c in v.causes[1:]:
        if c.name in ("error_in_few_rows", "error_in_few_columns", "int8_wrap"):
            continue
        m = re.search(r"explains (\d+)% of the error", c.detail)
        assert m and int(m.group(1)) >= 80, v.report()


def test_columns_off_by_one_percent_are_not_blamed_on_an_accumulator(rng):
    # a third of the columns 1% too large: the error's size is a bf16 accumulator's, but a narrow
    # accumulator leaves no column exact and is not one factor per column times the output
    M, K, N = 24, 1024, 48
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    out = run(xq, wq)
    out[:, N - N // 3:] *= 1.01
    v = check_linear(out, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "unexplained_logic_error", v.report()
    assert "accumulator_narrower_than_promised" not in [c.name for c in v.causes]


def test_large_outputs_are_diagnosed_on_a_sample_of_rows_and_columns(rng, monkeypatch):
    from lowbit.verify import diagnose
    monkeypatch.setattr(diagnose, "SAMPLE_WORK", 0)       # treat this small problem as a large one
    monkeypatch.setattr(diagnose, "SAMPLE_ROWS", 8)
    monkeypatch.setattr(diagnose, "SAMPLE_COLS", 16)
    for bug in ("scale_broadcast_stride0", "k_tail_dropped", "bias_before_scales", "nibble_order_swapped"):
        out, x, w, xs, ws, b = ZOO[bug](rng, 37, 259, 40)
        v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws, bias=b)
        assert v.causes[0].name == bug and v.causes[0].confirmed, v.report()
        assert "simulated on 8 of 37 rows and 16 of 40 columns" in v.causes[0].detail, v.report()


def test_bf16_accumulation_in_a_third_of_the_rows_is_not_an_accumulator(rng):
    # rows past 2M/3 computed by another code path that accumulates in bf16: errors of exactly a
    # bf16 accumulator's size, but two thirds of the rows are exact, which no accumulator does
    M, K, N = 30, 512, 26
    x, w = inputs(rng, M, K, N)
    out = x @ w.T
    cut = 2 * M // 3
    out[cut:] = _acc_kernel(x[cut:], w, 16, lambda t: t.to(torch.bfloat16).double()).float()
    v = check_linear(out, x, w)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "unexplained_logic_error", v.report()
    _partials_explain_most(v)


def test_every_column_off_by_its_own_small_factor_is_a_scale_bug_not_an_accumulator(rng):
    # per-channel factors 1 + 0.3% .. 1.1%: every column errs (as under an accumulator), but the
    # error is one factor per column times the output, which rounding errors are not
    M, K, N = 24, 1024, 40
    x, w = inputs(rng, M, K, N)
    xq, wq = lb.quantize(x, FP8R), lb.quantize(w, FP8R)
    f = 1 + 0.003 + 0.008 * torch.rand(N, generator=rng)
    out = run(xq, wq) * f[None, :]
    v = check_linear(out, x, w, x_scheme=FP8R, w_scheme=FP8R)
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == "unexplained_logic_error", v.report()
    assert "per column 100%" in v.causes[0].detail, v.report()
