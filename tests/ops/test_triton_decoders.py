"""The Triton kernels' one fp8 e4m3fn decoder (lowbit/ops/triton/common.py decode_e4m3fn, used by
the fused quantizer's NVFP4 scales, the W4A16 kernels' NVFP4 block scales and the group
dequantizer) against ml_dtypes, for every non-NaN code, as element and as block scale."""
import ml_dtypes
import numpy as np
import torch

from lowbit.ops.triton.dequant import dequantize_groups


def test_decode_e4m3fn_every_code(kernel_device, rng):
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                     # e4m3fn's two NaN codes are never produced
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)   # exact in bf16 (3 mantissa bits)
    # as elements (block scale 2^0: e8m0 code 127), a fresh order each run
    perm = torch.randperm(codes.size, generator=rng).numpy()
    c = torch.from_numpy(codes[perm].copy()).reshape(1, -1)
    sc = torch.full((1, codes.size // 2), 127, dtype=torch.uint8)
    got = dequantize_groups(c.to(kernel_device), sc.to(kernel_device), 2, "e4m3", "e8m0")
    assert np.array_equal(got.cpu().double().numpy().reshape(-1), want[perm])
    # as NVFP4 block scales of e2m1 1.0 (code 2): the value is the scale itself
    ones = torch.full((1, codes.size * 16), 2, dtype=torch.uint8)
    got = dequantize_groups(ones.to(kernel_device), c.to(kernel_device), 16, "e2m1", "e4m3")
    assert np.array_equal(got.cpu().double().numpy().reshape(-1, 16), np.repeat(want[perm][:, None], 16, axis=1))


def _bf16(bits) -> np.ndarray:
    """bfloat16 numbers from their 16-bit patterns (ml_dtypes: subnormals kept)."""
    return np.asarray(bits, dtype=np.uint16).view(ml_dtypes.bfloat16)


def test_fp4_folded_scale_arithmetic():
    """The bit recipes of the pairs kernel's folded fp4 scales (lowbit/ops/triton/w4a16.py,
    _fp4_mults / _fp4_plane; on the GPU inline PTX, so the interpreter cannot run them), replayed
    in bfloat16 arithmetic (ml_dtypes: float32 product, one round-to-nearest-even) for every
    code: the multiplier K of every e4m3 scale and every e8m0 scale in the allowed range, and t * K
    for every e2m1 code, against float64 values from ml_dtypes."""
    e2m1 = np.arange(16, dtype=np.uint8)
    v = e2m1.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    # the plane's pair: magnitude bits to 8..6, sign to 15: value * 2^-126
    t = _bf16(((e2m1.astype(np.uint32) & 7) << 6) | ((e2m1.astype(np.uint32) & 8) << 12))
    assert np.array_equal(t.astype(np.float64), v * 2.0 ** -126)
    # NVFP4: the code's magnitude bits at 10..4 and its sign at 15 read as s * 2^-120, times 2^119 twice
    c = np.arange(256, dtype=np.uint32)
    c = c[(c & 0x7F) != 0x7F]
    s = c.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    k = _bf16(((c & 127) << 4) | ((c & 128) << 8))
    assert np.array_equal(k.astype(np.float64), s * 2.0 ** -120)
    two119 = _bf16(np.full(c.shape, 0x7B00))
    k = (k * two119) * two119
    assert np.array_equal(k.astype(np.float64), s * 2.0 ** 118) and np.isfinite(k.astype(np.float64)).all()
    f = t[:, None] * k[None, :]                                       # every code x every scale
    assert np.array_equal(f.astype(np.float64), v[:, None] * s[None, :] * 2.0 ** -8)
    # MXFP4: K = bits (E + D) << 7 = 2^(E + D - 127) for E + D in [128, 254]
    ed = np.arange(128, 255, dtype=np.uint32)
    k = _bf16(ed << 7)
    assert np.array_equal(k.astype(np.float64), 2.0 ** (ed.astype(np.float64) - 127))
    f = t[:, None] * k[None, :]
    assert np.array_equal(f.astype(np.float64), v[:, None] * 2.0 ** (ed[None, :].astype(np.float64) - 253))


def test_fp4_folded_scale_byte_routing(rng):
    """_fp4_mults' word arithmetic: from a word of 4 scale codes (byte j = block j), the shifts and
    masks put bytes 0 / 2 in the low / high half of one word and bytes 1 / 3 in another, as
    the per-half patterns the test above checks (prmt then duplicates a half)."""
    sw = torch.randint(0, 2 ** 32, (4096,), generator=rng, dtype=torch.int64).numpy().astype(np.uint32)
    b = [(sw >> (8 * j)) & 255 for j in range(4)]
    lo, hi = (lambda w: w & 0xFFFF), (lambda w: w >> 16)
    nv = lambda c: ((c & 127) << 4) | ((c & 128) << 8)               # NVFP4's per-half pattern
    a = ((sw << np.uint32(4)) & 0x07F007F0) | ((sw << np.uint32(8)) & 0x80008000)
    bb = ((sw >> np.uint32(4)) & 0x07F007F0) | (sw & 0x80008000)
    assert np.array_equal(lo(a), nv(b[0])) and np.array_equal(hi(a), nv(b[2]))
    assert np.array_equal(lo(bb), nv(b[1])) and np.array_equal(hi(bb), nv(b[3]))
    a = (sw << np.uint32(7)) & 0x7F807F80                              # MXFP4: E << 7 per half
    bb = (sw >> np.uint32(1)) & 0x7F807F80
    assert np.array_equal(lo(a), b[0] << 7) and np.array_equal(hi(a), b[2] << 7)
    assert np.array_equal(lo(bb), b[1] << 7) and np.array_equal(hi(bb), b[3] << 7)


def test_dequantize_groups_tiles(kernel_device, rng):
    """dequantize_groups over rows and groups that span several programs with ragged edges (R not a
    multiple of the row tile, more groups than one program holds, a last program with fewer), for
    MXFP8 (e4m3 x e8m0) and NVFP4 (e2m1 x e4m3) codes, against ml_dtypes' decodings times the
    scales in float64: equal (the products are exact in bf16 over these codes)."""
    for element, scale, G in (("e4m3", "e8m0", 32), ("e2m1", "e4m3", 16)):
        R = int(torch.randint(17, 41, (1,), generator=rng))
        K = G * int(torch.randint(3, 21, (1,), generator=rng))
        hi = 256 if element == "e4m3" else 16
        c = torch.randint(0, hi, (R, K), generator=rng, dtype=torch.uint8)
        if element == "e4m3":
            c[(c & 0x7F) == 0x7F] = 0x7E                      # NaN codes are never produced
            sc = torch.randint(110, 141, (R, K // G), generator=rng, dtype=torch.uint8)
            vals = c.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            s = np.exp2(sc.numpy().astype(np.float64) - 127)
        else:
            sc = torch.randint(8, 0x7F, (R, K // G), generator=rng, dtype=torch.uint8)  # positive normals
            vals = c.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float64)
            s = sc.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        got = dequantize_groups(c.to(kernel_device), sc.to(kernel_device), G, element, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (R, K)
        assert np.array_equal(got.cpu().double().numpy(), vals * np.repeat(s, G, axis=1)), (element, R, K)
