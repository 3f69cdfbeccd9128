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
