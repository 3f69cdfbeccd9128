"""Fused RMSNorm / SiLU-mul + quantize and the standalone row quantizer (lowbit.ops.fused).

Each kernel result is checked three ways on fresh random data (odd sizes, zero rows):
1. codes, scales, scale codes and tensor scale equal lowbit.quantize applied to the float
   value the kernel quantized (the input itself, or the kernel's own normalized output);
2. that float value is within a derived bound of a float64 evaluation;
3. independent oracles: numpy / ml_dtypes element rounding, torchao's MX reference.
On the CPU the kernels run in Triton's interpreter; with CUDA the same tests run on the GPU.
"""
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.ops import fused
from lowbit.quantize import quantize as canonical_quantize
from lowbit.scheme import QuantScheme, get_preset

U32 = 2.0 ** -24


@pytest.fixture
def device(kernel_device):
    """Kernel tests run where the Triton kernel runs (conftest's kernel_device)."""
    return kernel_device
  # float32 unit roundoff

SCHEMES = {
    "int8_token": get_preset("int8_token"),
    "fp8_token": QuantScheme("fp8_e4m3fn", "token", dynamic=True),
    "int8_g64": QuantScheme("int8", "group", group_size=64),
    "fp8_1x128": get_preset("fp8_block1x128"),
    "mxfp8": get_preset("mxfp8"),
    "mxfp8_rceil": QuantScheme("fp8_e4m3fn", "group", group_size=32, scale_format="e8m0", scale_rounding="rceil"),
    "mxfp4": get_preset("mxfp4"),
    "mxfp4_even": QuantScheme("fp4_e2m1fn", "group", group_size=32, scale_format="e8m0", scale_rounding="even"),
    "mxfp4_ceil": QuantScheme("fp4_e2m1fn", "group", group_size=32, scale_format="e8m0", scale_rounding="ceil"),
    "nvfp4": get_preset("nvfp4"),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _hidden(scheme):
    # odd sizes: 4095 for per-row scales; for groups a K that is not a power of two
    return 4095 if scheme.strategy == "token" else 384


def _rand(rng, shape, dtype, device, scale=3.0, zero_row=1):
    x = torch.randn(shape, generator=rng) * scale
    x[..., :7] *= 20  # a few outlier channels, as activations have
    if zero_row is not None and x.shape[0] > zero_row:
        x[zero_row] = 0
    return x.to(dtype).to(device)


def _assert_same_quant(qt, ref):
    assert qt.codes.dtype == ref.codes.dtype and qt.codes.shape == ref.codes.shape
    bad = (qt.codes != ref.codes).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} codes differ, first at {bad[0].tolist()}"
    assert qt.scale.shape == ref.scale.shape
    assert torch.equal(qt.scale, ref.scale), "scales differ"
    if ref.scale_codes is None:
        assert qt.scale_codes is None
    else:
        assert torch.equal(qt.scale_codes, ref.scale_codes), "scale codes differ"
    if ref.global_scale is None:
        assert qt.global_scale is None
    else:
        assert torch.equal(qt.global_scale, ref.global_scale), "tensor scales differ"


TILE_SCHEMES = ("int8_token", "fp8_token")  # the "tile" kernel's per-token fast path (fused.tile_supports)
KERNEL_CASES = [(n, k) for n in SCHEMES for k in ("row", "tile")]  # "tile" takes the rest in its group variant


@pytest.mark.parametrize("name,kernel", KERNEL_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_equals_canonical(name, kernel, dtype, device, rng):
    scheme = SCHEMES[name]
    x = _rand(rng, (3, 2, _hidden(scheme)), dtype, device)
    qt = fused.quantize_rows(x, scheme, backend="triton", kernel=kernel)
    ref = canonical_quantize(x.cpu(), scheme)
    _assert_same_quant(qt.to("cpu"), ref)
    assert qt.shape == tuple(x.shape)
    # zero row: zero values back, finite scales
    deq = qt.dequantize().cpu()
    assert torch.all(deq[1] == 0) and torch.isfinite(qt.scale).all()


@pytest.mark.parametrize("name,kernel", [("int8_token", "row"), ("fp8_token", "row"), ("mxfp8", "row"),
                                         ("nvfp4", "row"), ("int8_token", "tile"), ("fp8_token", "tile"),
                                         ("mxfp8", "tile"), ("nvfp4", "tile"), ("mxfp4", "tile")])
def test_rmsnorm_quant(name, kernel, device, rng):
    scheme = SCHEMES[name]
    # odd hidden sizes, and one power of two (the kernel then drops its masks)
    for M, res_dtype, K in ((1, None, _hidden(scheme)), (3, torch.bfloat16, _hidden(scheme)),
                            (17, torch.float32, 512)):
        x = _rand(rng, (M, K), torch.bfloat16, device, zero_row=1 if M > 1 else None)
        w = (1 + 0.2 * torch.randn(K, generator=rng)).to(torch.bfloat16).to(device)
        r = None if res_dtype is None else _rand(rng, (M, K), res_dtype, device, zero_row=None)
        if r is not None and M > 1:
            r[1] = -x[1].to(res_dtype)  # the residual sum of row 1 is exactly zero
        eps = 1e-6
        qt, new_r, y = fused.rmsnorm_quant(x, w, eps, scheme, residual=r, backend="triton",
                                           return_normalized=True, kernel=kernel)
        _assert_same_quant(qt.to("cpu"), canonical_quantize(y.cpu(), scheme))
        # the residual stream: x + r in float32, rounded once to r's dtype; never quantized
        if r is None:
            assert new_r is None
            h64 = x.cpu().double()
        else:
            assert new_r.dtype == r.dtype
            assert torch.equal(new_r.cpu(), (x.cpu().float() + r.cpu().float()).to(res_dtype))
            h64 = new_r.cpu().double()
        # float64 RMSNorm; bound on the kernel's float32 evaluation (relative, per element):
        # sum of K rounded squares <= gamma_K ~ K*u (any order); /K, +eps, 1/x: 3u; sqrt halves
        # the argument's error and adds u; two products: 2u  =>  ((K + 3) / 2 + 4) * u.
        y64 = h64 / torch.sqrt((h64 * h64).mean(-1, keepdim=True) + eps) * w.cpu().double()
        bound = ((K + 3) / 2 + 4) * U32 * y64.abs()
        assert torch.all((y.cpu().double() - y64).abs() <= bound)
        if M > 1:  # zero row in, zero codes out, finite scale
            assert torch.all(qt.dequantize().cpu()[1] == 0) and torch.isfinite(qt.scale).all()


@pytest.mark.parametrize("name,kernel", [("int8_token", "row"), ("fp8_token", "row"), ("mxfp4", "row"),
                                         ("nvfp4", "row"), ("int8_token", "tile"), ("fp8_token", "tile"),
                                         ("mxfp4", "tile"), ("nvfp4", "tile")])
def test_silu_mul_quant(name, kernel, device, rng):
    scheme = SCHEMES[name]
    H = _hidden(scheme)
    for M in (1, 3, 17):
        x = _rand(rng, (M, 2 * H), torch.bfloat16, device, scale=2.0, zero_row=1 if M > 1 else None)
        with warnings.catch_warnings():  # the interpreter's numpy exp warns where exp(-g) overflows
            warnings.simplefilter("ignore", RuntimeWarning)
            qt, y = fused.silu_mul_quant(x, scheme, backend="triton", return_product=True, kernel=kernel)
        assert qt.codes.shape == (M, H)
        _assert_same_quant(qt.to("cpu"), canonical_quantize(y.cpu(), scheme))
        g, u = x.cpu().double()[:, :H], x.cpu().double()[:, H:]
        y64 = g / (1 + torch.exp(-g)) * u
        # exp(-g) in float32: the product g*log2(e) carries |g|*u of absolute exponent error,
        # i.e. |g|*u relative in exp, plus <= 4u for the exp itself; 1 + e adds u, the
        # (approximate, div.full: <= 2 ulp) division 4u, the product with up u (silu's
        # sensitivity to exp's error is <= 1): (|g| + 10) u, taken as (|g| + 12) u.
        # Where exp(-g) overflows float32 (g < -88.7) the kernel returns -0.0: allowed there,
        # the true |y| <= 89 * e^-88.7 * |up| ~ 3e-37 |up| is below float32's normal range.
        bound = (g.abs() + 12) * U32 * y64.abs() + torch.where(g < -88, y64.abs(), 0)
        assert torch.all((y.cpu().double() - y64).abs() <= bound)
        if M > 1:
            assert torch.all(qt.dequantize().cpu()[1] == 0)


def test_backends_agree_on_rmsnorm(device, rng):
    """The PyTorch twin and the kernel: same algorithm; codes may differ only where the two
    float32 evaluations of y differ (reduction order), so compare y within the bound and
    codes exactly wherever the two y agree bit for bit."""
    scheme = SCHEMES["int8_token"]
    K = 1000
    x = _rand(rng, (5, K), torch.bfloat16, device)
    w = torch.randn(K, generator=rng).to(torch.bfloat16).to(device)
    qt_k, _, y_k = fused.rmsnorm_quant(x, w, 1e-5, scheme, backend="triton", return_normalized=True)
    qt_t, _, y_t = fused.rmsnorm_quant(x, w, 1e-5, scheme, backend="torch", return_normalized=True)
    bound = ((K + 3) + 8) * U32 * y_t.abs()  # both within the one-sided bound of y64
    assert torch.all((y_k - y_t).abs() <= bound)
    same_row = (y_k == y_t).all(-1)
    assert torch.equal(qt_k.codes[same_row], qt_t.codes[same_row])


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3fn", "fp4_e2m1fn"])
def test_elements_against_numpy_and_ml_dtypes(fmt, device, rng):
    """Independent oracle for the element rounding: numpy rint (half even) for int8 and
    ml_dtypes' float8_e4m3fn / float4_e2m1fn casts, applied to x / s with the kernel's s,
    and s = amax / max computed in numpy float32."""
    scheme = QuantScheme(fmt, "group", group_size=32) if fmt != "int8" else get_preset("int8_token")
    x = _rand(rng, (4, 224), torch.float32, device)
    qt = fused.quantize_rows(x, scheme, backend="triton")
    xn = x.cpu().numpy()
    G = 224 if fmt == "int8" else 32
    xg = xn.reshape(4, -1, G)
    fmax = {"int8": 127.0, "fp8_e4m3fn": 448.0, "fp4_e2m1fn": 6.0}[fmt]
    s = (np.abs(xg).max(-1) / np.float32(fmax)).astype(np.float32)
    s = np.where(s == 0, np.float32(1), s)
    np.testing.assert_array_equal(qt.scale.cpu().numpy().reshape(s.shape), s)
    v = (xg / s[..., None]).astype(np.float32).reshape(4, -1)
    codes = qt.codes.cpu().numpy()
    if fmt == "int8":
        np.testing.assert_array_equal(codes, np.clip(np.rint(v), -127, 127).astype(np.int8))
    else:
        mdt = ml_dtypes.float8_e4m3fn if fmt == "fp8_e4m3fn" else ml_dtypes.float4_e2m1fn
        exp = np.clip(v, -fmax, fmax).astype(mdt)
        if fmt == "fp8_e4m3fn":
            np.testing.assert_array_equal(codes, exp.view(np.uint8))
        else:  # ml_dtypes keeps fp4 in a byte: value bits in the low nibble
            np.testing.assert_array_equal(codes, exp.view(np.uint8) & 0xF)


def test_mx_against_torchao(device, rng):
    """torchao's MX reference (to_mx, FLOOR scaling) as an independent oracle for MXFP8."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = _rand(rng, (6, 256), torch.bfloat16, "cpu", zero_row=None)
    qt = fused.quantize_rows(x.to(device), get_preset("mxfp8"), backend="triton").to("cpu")
    scale_e8m0, data = mx.to_mx(x, torch.float8_e4m3fn, 32)
    assert torch.equal(qt.scale_codes.reshape(-1), scale_e8m0.view(torch.uint8).reshape(-1))
    assert torch.equal(qt.codes, data.view(torch.uint8))


def test_gpu_fp8_hardware_cast_matches(device, rng):
    """On CUDA the fp8 codes come from the hardware cast; the integer encoder is the other
    path. Both must equal the canonical quantizer at a realistic size."""
    if device != "cuda":
        pytest.skip("the hardware fp8 cast exists only on CUDA")
    x = _rand(rng, (512, 4096), torch.bfloat16, device)
    x[::7, ::5] = -0.0  # signed zeros through the fast division
    w = torch.randn(4096, generator=rng).to(torch.bfloat16).to(device)
    for name in ("fp8_token", "int8_token", "mxfp8"):  # mxfp8 under "tile": the group variant
        scheme = SCHEMES[name]
        for enc, kernel in (("hw", "row"), ("int", "row"), ("hw", "tile"), ("int", "tile")):
            qt, _, y = fused.rmsnorm_quant(x, w, 1e-6, scheme, backend="triton", return_normalized=True,
                                           fp8_encoder=enc, kernel=kernel)
            _assert_same_quant(qt.to("cpu"), canonical_quantize(y.cpu(), scheme))
    # persistent token tiles: 512 rows over 132 SMs, so each program steps over several tiles
    r = _rand(rng, (512, 4096), torch.bfloat16, device, zero_row=None)
    for name in ("fp8_token", "int8_token"):
        for tile in ((1, 4, 1), (2, 4, 2)):
            qt, new_r, y = fused.rmsnorm_quant(x, w, 1e-6, SCHEMES[name], residual=r if tile[0] > 1 else None,
                                               backend="triton", return_normalized=True, kernel="tile", tile=tile)
            _assert_same_quant(qt.to("cpu"), canonical_quantize(y.cpu(), SCHEMES[name]))
            if tile[0] > 1:
                assert torch.equal(new_r, (x.float() + r.float()).to(torch.bfloat16))
    # amax ~1e-37: subnormal scales, the division branch the fast path leaves to IEEE / scaled operands
    tiny = _rand(rng, (64, 4095), torch.float32, device, zero_row=None) * 1e-39  # no zero row: its scale is 1.0
    for name in ("fp8_token", "int8_token"):
        for kernel in ("row", "tile"):
            qt = fused.quantize_rows(tiny, SCHEMES[name], backend="triton", kernel=kernel)
            assert float(qt.scale.max()) < 1.1754943508222875e-38
            _assert_same_quant(qt.to("cpu"), canonical_quantize(tiny.cpu(), SCHEMES[name]))


@pytest.mark.parametrize("tile", [(1, 2), (2, 1), (4, 2), (8, 4), (1, 2, 1), (2, 2, 3)])
@pytest.mark.parametrize("name", TILE_SCHEMES + ("mxfp4", "nvfp4", "fp8_1x128"))
def test_tile_configs_match_row_kernel(tile, name, device, rng):
    """Every (ROWS, num_warps) of the "tile" kernel gives the codes and scales of lowbit.quantize
    on its own y, the "row" kernel's new residual, and its y within the float32 evaluation bound
    (same arithmetic; on the GPU the sum of squares may be added in another order), with the
    same codes wherever the two y agree bit for bit: row counts that ROWS does not divide
    (masked tail), odd and power-of-two K, signed zeros (the fast division's sign handling on
    the GPU), a zero row."""
    scheme = SCHEMES[name]
    if len(tile) == 3 and not fused.tile_supports(scheme):  # persistent programs: per-token fast path only
        with pytest.raises(ValueError, match="per-token int8 / fp8 fast path only"):
            fused.quantize_rows(_rand(rng, (4, 256), torch.bfloat16, device), scheme, backend="triton",
                                kernel="tile", tile=tile)
        return
    odd_k = 200 if scheme.strategy == "token" else 224  # group schemes: a K that is a multiple of the group
    if name == "fp8_1x128":
        odd_k = 384
    # 2 * ROWS + 1 rows: a masked tail program; persistent tiles (a third entry, P programs per SM):
    # 9 * ROWS * P + 1 rows, so every program steps over several tiles (4 SMs in the interpreter)
    tail = 2 * tile[0] + 1 if len(tile) == 2 else 9 * tile[0] * tile[2] + 1
    for M, K in ((5, odd_k), (tail, 256)):
        x = _rand(rng, (M, K), torch.bfloat16, device)
        x[0, 3:9] = -0.0  # -0 in, -0 out of the division: fp8 code 0x80, as canonical
        w = (1 + 0.2 * torch.randn(K, generator=rng)).to(torch.bfloat16).to(device)
        r = _rand(rng, (M, K), torch.float32, device, zero_row=None)
        if tile[0] == 1:  # one row per program takes no residual (non-canonical scales on sm_90)
            with pytest.raises(ValueError, match="one row per program"):
                fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=r, backend="triton", kernel="tile", tile=tile)
            r = None
        out_t = fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=r, backend="triton", return_normalized=True,
                                    kernel="tile", tile=tile)
        out_r = fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=r, backend="triton", return_normalized=True,
                                    kernel="row")
        _assert_same_quant(out_t[0].to("cpu"), canonical_quantize(out_t[2].cpu(), scheme))
        assert (r is None and out_t[1] is None and out_r[1] is None) or torch.equal(out_t[1], out_r[1])
        y_t, y_r = out_t[2].cpu(), out_r[2].cpu()
        assert torch.all((y_t - y_r).abs() <= ((K + 3) + 8) * U32 * y_r.abs())  # both within the bound of y64
        same = (y_t == y_r).all(-1)
        # rows whose y agree get the same codes, under the same NVFP4 tensor scale: that scale comes from the
        # whole tensor's amax, so a row whose y differs in its last bit (allowed above) may move it by an ulp
        # and with it codes elsewhere (both sides' codes are lowbit.quantize's of their own y: checked above)
        g_t, g_r = out_t[0].global_scale, out_r[0].global_scale
        if g_t is None or torch.equal(g_t, g_r):
            assert torch.equal(out_t[0].codes.cpu()[same], out_r[0].codes.cpu()[same])
        qt = fused.quantize_rows(x, scheme, backend="triton", kernel="tile", tile=tile)
        _assert_same_quant(qt.to("cpu"), canonical_quantize(x.cpu(), scheme))
        if name == "fp8_token":
            assert torch.all(qt.codes[0, 3:9].cpu() == 0x80)


def test_kernel_choice(device, rng, monkeypatch):
    """kernel=None follows DEFAULT_KERNEL, per entry point and scheme kind (":group" for the
    schemes outside the per-token fast path); every choice gives the canonical result; pack=True
    takes the tile kernel and refuses an explicit "row"."""
    from lowbit.ops.fused_configs import resolve_kernel

    x = _rand(rng, (4, 96), torch.bfloat16, device)
    for default in ("row", "tile"):
        monkeypatch.setitem(fused.DEFAULT_KERNEL, "quantize_rows", default)
        monkeypatch.setitem(fused.DEFAULT_KERNEL, "quantize_rows:group", default)
        for name in ("int8_token", "mxfp8"):
            assert resolve_kernel(None, SCHEMES[name], "quantize_rows") == default
            _assert_same_quant(fused.quantize_rows(x, SCHEMES[name], backend="triton").to("cpu"),
                               canonical_quantize(x.cpu(), SCHEMES[name]))
    assert resolve_kernel(None, SCHEMES["mxfp4"], "quantize_rows", pack=True) == "tile"
    with pytest.raises(ValueError, match="only kernel='tile'"):
        fused.quantize_rows(x, SCHEMES["mxfp4"], backend="triton", kernel="row", pack=True)
    with pytest.raises(ValueError, match="kernel must be one of"):
        fused.quantize_rows(x, SCHEMES["int8_token"], backend="triton", kernel="fast")
    with pytest.raises(ValueError, match="powers of two"):
        fused.quantize_rows(x, SCHEMES["int8_token"], backend="triton", kernel="tile", tile=(3, 4))


def test_clear_errors(device, rng):
    x = torch.randn(2, 96, generator=rng).to(device)
    w = torch.ones(96).to(device)
    with pytest.raises(ValueError, match="not a multiple of the group width"):
        fused.quantize_rows(x, QuantScheme("fp8_e4m3fn", "group", group_size=64), backend="triton")
    with pytest.raises(NotImplementedError, match="power of two"):
        fused.quantize_rows(x, QuantScheme("int8", "group", group_size=48), backend="triton")
    with pytest.raises(NotImplementedError, match="asymmetric"):
        fused.quantize_rows(x, QuantScheme("int8", "token", symmetric=False), backend="triton")
    with pytest.raises(NotImplementedError, match="whole-tensor"):
        fused.quantize_rows(x, get_preset("fp8_tensor"), backend="triton")
    with pytest.raises(ValueError, match="exceeds the fused kernel"):
        fused.quantize_rows(torch.randn(1, 40000, generator=rng).to(device), get_preset("int8_token"), backend="triton")
    with pytest.raises(ValueError, match="weight must be a tensor of shape"):
        fused.rmsnorm_quant(x, torch.ones(95), 1e-6, get_preset("int8_token"), backend="triton")
    with pytest.raises(ValueError, match="must be even"):
        fused.silu_mul_quant(torch.randn(2, 7, generator=rng).to(device), get_preset("int8_token"), backend="triton")
    with pytest.raises(TypeError, match="dtype"):
        fused.quantize_rows(x.to(torch.int32), get_preset("int8_token"), backend="triton")
    bad = x.clone()
    bad[1, 5] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        fused.rmsnorm_quant(bad, w, 1e-6, get_preset("int8_token"), backend="triton")
    bad[1, 5] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        fused.quantize_rows(bad, get_preset("mxfp8"), backend="triton")


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "nvfp4"])
def test_default_tile_at_4096(name, device, rng):
    """The default tile at K = 4096: MX scales (e8m0) take one row and 2 warps (64 elements per
    thread), NVFP4 and the per-token path keep 4 warps; quantize and RMSNorm + quantize under it give
    lowbit.quantize's codes and scales (3 rows, one of them zero; a masked tail for none: K is a power of two)."""
    scheme = SCHEMES[name]
    assert fused.default_tile(scheme, 4096, 0) == ((1, 2) if name.startswith("mx") else (1, 4))
    assert fused.default_tile(scheme, 4096, 1, residual=True) == (2, 4)  # a residual keeps 2 rows, 4 warps
    x = _rand(rng, (3, 4096), torch.bfloat16, device)
    _assert_same_quant(fused.quantize_rows(x, scheme, backend="triton", kernel="tile").to("cpu"),
                       canonical_quantize(x.cpu(), scheme))
    w = (1 + 0.2 * torch.randn(4096, generator=rng)).to(torch.bfloat16).to(device)
    qt, _, y = fused.rmsnorm_quant(x, w, 1e-6, scheme, backend="triton", return_normalized=True, kernel="tile")
    _assert_same_quant(qt.to("cpu"), canonical_quantize(y.cpu(), scheme))


def test_tile_one_row_one_warp_is_refused(device, rng):
    """tile=(1, 1) gave per-token scales that differ from lowbit.quantize on the H200 (codes
    equal; cause not found): the kernel refuses it and the heuristic never picks it."""
    from lowbit.ops.fused import tile_config

    x = _rand(rng, (3, 1000), torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"tile=\(1, 1\)"):
        fused.quantize_rows(x, SCHEMES["int8_token"], backend="triton", kernel="tile", tile=(1, 1))
    assert all(tile_config(K, 0, mx=mx) != (1, 1) for K in (64, 513, 768, 1000, 1024, 4095, 8192)
               for mx in (False, True))


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "mxfp4_even"])
def test_fp4_codes_packed_two_per_byte(name, device, rng):
    """pack=True: the kernel writes fp4 codes two per byte, element 2j in the low nibble; checked
    against the canonical codes packed by numpy (an oracle independent of lowbit.packing), for
    all three entry points, odd row counts (masked tail programs) and both backends."""
    scheme = SCHEMES[name]
    K = 384
    x = _rand(rng, (7, K), torch.bfloat16, device)
    w = (1 + 0.2 * torch.randn(K, generator=rng)).to(torch.bfloat16).to(device)
    r = _rand(rng, (7, K), torch.bfloat16, device, zero_row=None)

    def nibbles(codes):
        c = codes.cpu().numpy().astype(np.uint8)
        return torch.from_numpy(c[..., 0::2] | (c[..., 1::2] << 4))

    for backend in ("triton", "torch"):
        pq = fused.quantize_rows(x, scheme, backend=backend, pack=True)
        ref = canonical_quantize(x.cpu(), scheme)
        assert pq.packed.dtype == torch.uint8 and tuple(pq.packed.shape) == (7, K // 2)
        assert torch.equal(pq.packed.cpu(), nibbles(ref.codes))
        _assert_same_quant(pq.unpack().to("cpu"), ref)
        assert torch.equal(pq.dequantize().cpu(), ref.dequantize())
        pq, new_r, y = fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=r, backend=backend, pack=True,
                                           return_normalized=True)
        assert torch.equal(pq.packed.cpu(), nibbles(canonical_quantize(y.cpu(), scheme).codes))
        pq, y = fused.silu_mul_quant(torch.cat([x, r], -1), scheme, backend=backend, pack=True, return_product=True)
        assert torch.equal(pq.packed.cpu(), nibbles(canonical_quantize(y.cpu(), scheme).codes))


def test_pack_refuses_what_it_cannot_pack(device, rng):
    x = _rand(rng, (2, 96), torch.bfloat16, device)
    with pytest.raises(ValueError, match="pack=True packs 4-bit codes"):
        fused.quantize_rows(x, SCHEMES["mxfp8"], backend="triton", pack=True)
    with pytest.raises(ValueError, match="even hidden size"):
        fused.quantize_rows(_rand(rng, (2, 95), torch.bfloat16, device),
                            QuantScheme("fp4_e2m1fn", "token", dynamic=True), backend="triton", pack=True)
    with pytest.raises(TypeError, match="pack must be True or False"):
        fused.quantize_rows(x, SCHEMES["mxfp4"], backend="triton", pack="yes")


def test_e2m1_encoder_at_every_rounding_boundary(device, rng):
    """The fp4 encoder against ml_dtypes' float4_e2m1fn cast on the values where rounding
    decides: every midpoint of the e2m1 grid and its float32 neighbours (1 and 2 ulps either
    side), the grid itself, signed zeros, subnormal inputs and random values. Each group of 32
    holds +-6.0, so with fp32 group scales s = amax / 6 = 1 and the encoder sees the values
    themselves. Then saturation: MXFP4's floor e8m0 scale puts a group with amax 7.5 at s = 1,
    so 6 < |y / s| < 8 must encode as +-6."""
    f32 = np.float32
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=f32)
    up1, dn1 = np.nextafter(mids, f32(np.inf)), np.nextafter(mids, f32(0))
    up2, dn2 = np.nextafter(up1, f32(np.inf)), np.nextafter(dn1, f32(0))
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=f32)
    vals = np.concatenate([mids, up1, dn1, up2, dn2, grid, np.array([1e-40, 1e-30], dtype=f32)])
    vals = np.concatenate([vals, -vals, np.array([-0.0], dtype=f32),
                           (torch.rand(31 * 40, generator=rng) * 12 - 6).numpy().astype(f32)])
    vals = np.concatenate([vals, np.zeros((-len(vals)) % 31, dtype=f32)])
    groups = vals.reshape(-1, 31)
    six = np.where(np.arange(len(groups)) % 2 == 0, 6.0, -6.0).astype(f32)[:, None]
    x = torch.from_numpy(np.concatenate([groups, six], 1).reshape(1, -1))
    qt = fused.quantize_rows(x.to(device), QuantScheme("fp4_e2m1fn", "group", group_size=32), backend="triton")
    assert torch.all(qt.scale.cpu() == 1.0)
    np.testing.assert_array_equal(qt.codes.cpu().numpy(), x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)
    sat = torch.tensor([[7.5, 6.0001, 7.0, -7.49, -6.5, 6.0, 5.0, 1.0] * 4])
    qt = fused.quantize_rows(sat.to(device), SCHEMES["mxfp4"], backend="triton")
    assert float(qt.scale.reshape(-1)[0]) == 1.0
    np.testing.assert_array_equal(qt.codes.cpu().numpy(),
                                  np.clip(sat.numpy(), -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)


@pytest.mark.parametrize("name,kernel", [("int8_token", "row"), ("int8_token", "tile"), ("mxfp8", "row"),
                                         ("mxfp8", "tile"), ("mxfp4", "tile"), ("nvfp4", "row"), ("nvfp4", "tile")])
def test_non_finite_groups_get_nan_scales(name, kernel, device, rng):
    """A NaN, +inf or -inf makes its group's scale NaN (what check_finite=True refuses) and leaves
    every other group as lowbit.quantize makes it from the finite values: a group's absmax counts
    a NaN as +inf, however the kernel reduces (a NaN-propagating max, mapped once per group).
    NVFP4 with a given tensor scale, so that groups are independent (the live amax would be inf)."""
    from lowbit.quantize import compute_scale, reduce_amax, two_level_global_scale

    scheme = SCHEMES[name]
    M, K = 7, _hidden(scheme)
    G = K if scheme.strategy == "token" else scheme.group_size
    x = _rand(rng, (M, K), torch.bfloat16, "cpu", zero_row=None)
    rows = torch.randperm(M, generator=rng)[:3]
    cols = torch.randint(0, K, (3,), generator=rng)
    for r, c, v in zip(rows.tolist(), cols.tolist(), (math.nan, math.inf, -math.inf)):
        x[r, c] = v
    bad = torch.zeros(M, K // G, dtype=torch.bool)
    bad[rows, cols // G] = True
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    kw, ref_kw = {}, {}
    if name == "nvfp4":
        g = two_level_global_scale(clean.float().abs().max(), scheme).reshape(1)
        kw = dict(global_scale=g.to(device))
        ref_kw = dict(scales=compute_scale(reduce_amax(clean, scheme), scheme, global_scale=g))
    qt = fused.quantize_rows(x.to(device), scheme, backend="triton", kernel=kernel, check_finite=False,
                             **kw).to("cpu")
    assert torch.equal(torch.isnan(qt.scale), bad)
    ref = canonical_quantize(clean, scheme, **ref_kw)
    assert torch.equal(qt.scale[~bad], ref.scale[~bad])
    ok = (~bad).repeat_interleave(G, 1)  # the elements of the finite groups
    assert torch.equal(qt.codes[ok], ref.codes[ok])
    with pytest.raises(ValueError, match="NaN or Inf"):
        fused.quantize_rows(x.to(device), scheme, backend="triton", kernel=kernel, **kw)


@pytest.mark.parametrize("kernel", ["row", "tile"])
def test_nvfp4_with_calibrated_tensor_scale(kernel, device, rng):
    """global_scale: NVFP4 block scales relative to a given (calibrated) tensor scale g, one pass.
    Checked against lowbit.quantize with compute_scale(..., global_scale=g) on the kernel's own y,
    with g at the live tensor's value, 4x below it (block scales saturate at 448, codes at +-6:
    a calibration that saw smaller activations) and 8x above it."""
    from lowbit.quantize import compute_scale, reduce_amax, two_level_global_scale

    scheme = SCHEMES["nvfp4"]
    K = 384
    x = _rand(rng, (9, K), torch.bfloat16, device)
    w = (1 + 0.2 * torch.randn(K, generator=rng)).to(torch.bfloat16).to(device)
    r = _rand(rng, (9, K), torch.bfloat16, device, zero_row=None)

    def ref(y, g):
        y = y.cpu()
        return canonical_quantize(y, scheme, scales=compute_scale(reduce_amax(y, scheme), scheme, global_scale=g.cpu()))

    live = two_level_global_scale(x.float().abs().max().cpu(), scheme)
    for factor in (1.0, 0.25, 8.0):
        g = (live * factor).reshape(1).to(device)
        qt = fused.quantize_rows(x, scheme, backend="triton", kernel=kernel, global_scale=g, check_finite=False)
        _assert_same_quant(qt.to("cpu"), ref(x, g))
        if factor == 0.25:  # the saturating case really saturates
            assert int(qt.scale_codes.max()) == 0x7E and int((qt.codes.cpu() & 7).max()) == 7
        res = r if kernel == "tile" else None  # the row kernel takes a residual too; one case each is enough
        qt, _, y = fused.rmsnorm_quant(x, w, 1e-6, scheme, residual=res, backend="triton", kernel=kernel,
                                       global_scale=g, return_normalized=True)
        _assert_same_quant(qt.to("cpu"), ref(y, g))
        qt, y = fused.silu_mul_quant(torch.cat([x, r], -1), scheme, backend="triton", kernel=kernel,
                                     global_scale=g, return_product=True)
        _assert_same_quant(qt.to("cpu"), ref(y, g))
        tw = fused.quantize_rows(x, scheme, backend="torch", global_scale=g)
        _assert_same_quant(tw.to("cpu"), ref(x, g))


def test_global_scale_refusals(device, rng):
    x = _rand(rng, (2, 64), torch.bfloat16, device)
    g = torch.ones(1, device=device)
    with pytest.raises(ValueError, match="two-level"):
        fused.quantize_rows(x, SCHEMES["mxfp4"], backend="triton", global_scale=g)
    with pytest.raises(ValueError, match="float32 tensor with one element"):
        fused.quantize_rows(x, SCHEMES["nvfp4"], backend="triton", global_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="finite and > 0"):
        fused.quantize_rows(x, SCHEMES["nvfp4"], backend="triton", global_scale=torch.zeros(1, device=device))
    # check_finite=False reads no value on the host (CUDA graphs): the scale is the caller's to vouch for
    g = torch.full((1,), 0.01, device=device)
    qt = fused.quantize_rows(x, SCHEMES["nvfp4"], backend="triton", global_scale=g, check_finite=False)
    assert torch.equal(qt.global_scale.reshape(1).cpu(), g.cpu())


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_even", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qdq_rows_equals_canonical(name, dtype, device, rng):
    """qdq_rows (the W4A4 emulation's activation at decode sizes: quantize and dequantize in one
    kernel) against lowbit.quantize: every value e2m1 * block scale, decoded here with ml_dtypes
    from the canonical codes and scale codes, bit for bit; NVFP4's product of tensor scales
    = weight scale * the canonical tensor scale (one float32 product). One row (NVFP4: the row's
    own amax is the tensor's), several (the absmax launch first) and more than QDQ_MAX_ROWS (their
    max reduced by torch first: prefill sizes), K a tile multiple or not."""
    scheme = SCHEMES[name]
    for M, K in ((1, 256), (5, 160), (3, 384), (fused.QDQ_MAX_ROWS + 7, 96)):
        x = _rand(rng, (M, K), dtype, device, zero_row=1 if M > 1 else None)
        wg = (torch.rand(1, generator=rng) + 0.5).to(device)
        xd, gs = fused.qdq_rows(x, scheme, wg if name == "nvfp4" else None)
        ref = canonical_quantize(x.cpu(), scheme)
        vals = ref.codes.numpy().astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        sc = ref.scale_codes.numpy().astype(np.uint8)
        s = (sc.view(ml_dtypes.float8_e4m3fn).astype(np.float64) if name == "nvfp4"
             else np.exp2(sc.astype(np.float64) - 127))
        want = vals * np.repeat(s, scheme.group_size, axis=1)
        assert xd.dtype == torch.bfloat16 and xd.shape == (M, K)
        assert np.array_equal(xd.cpu().double().numpy(), want), (M, K)
        if name == "nvfp4":
            assert torch.equal(gs.cpu(), wg.cpu() * ref.global_scale.reshape(1).float())
        else:
            assert gs is None


def test_qdq_rows_refusals(device, rng):
    x = torch.randn(2, 96, generator=rng).to(device)
    with pytest.raises(ValueError, match="MXFP4 / NVFP4"):
        fused.qdq_rows(x, SCHEMES["mxfp8"])

