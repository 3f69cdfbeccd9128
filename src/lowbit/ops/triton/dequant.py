"""Block-scaled codes -> bf16, one pass: what the MX / NVFP4 emulation multiplies on Hopper.

    out[r, k] = decode(codes[r, k]) * decode_scale(scale_codes[r, k // G])

Elements: fp8 e4m3fn (MXFP8) or fp4 e2m1fn (MXFP4 / NVFP4; one code per byte, as the fused
quantizer writes them). Scales: e8m0 (2^(c - 127)) or fp8 e4m3fn (NVFP4's block scale; its
per-tensor fp32 scale is NOT applied here: the caller multiplies the fp32 accumulator by it).
Every product is exact in bf16: e4m3 x 2^e has 4 significant bits, e2m1 x e4m3 at most 6,
and bf16 has fp32's exponent range (|value| <= 448 * 2^127 stays finite for the e8m0 codes
1..254 real data produces). So a bf16 tensor-core GEMM on two such tensors with fp32
accumulation computes exactly the products the MX / NVFP4 definition asks for.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import decode_e4m3fn, interpreting, launch
from .fused_quant import round_to
from .w4a16 import _e2m1_value, block_scale

E4M3, E2M1 = 0, 1
E8M0, SCALE_E4M3 = 2, 3   # block_scale's codes (w4a16.py: MXFP4 = 2, NVFP4 = 3)


@triton.jit
def _group_dequant_kernel(C, SC, OUT, R, K, s_c, s_sc, s_o,
                          EFMT: tl.constexpr, SFMT: tl.constexpr, G: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    ok = (rows < R)[:, None] & (cols < K)[None, :]
    c = tl.load(C + r64 * s_c + cols[None, :], mask=ok, other=0).to(tl.int32)
    sc = tl.load(SC + r64 * s_sc + (cols // G)[None, :], mask=ok, other=127).to(tl.int32)
    if EFMT == 0:
        v = decode_e4m3fn(c)
    else:
        v = _e2m1_value(c)
    s = block_scale(sc, SFMT)
    tl.store(OUT + r64 * s_o + cols[None, :], round_to(v * s, OUT.dtype.element_ty), mask=ok)


def dequantize_groups(codes: torch.Tensor, scale_codes: torch.Tensor, group: int, element: str,
                      scale: str) -> torch.Tensor:
    """codes uint8 [R, K] (element "e4m3" or "e2m1"), scale_codes uint8 [R, K // group] (scale
    "e8m0" or "e4m3") -> bf16 [R, K]. No argument checks: lowbit.nn.runtime checks at prepare
    time; made per call, never kept."""
    R, K = codes.shape
    out = torch.empty((R, K), dtype=torch.bfloat16, device=codes.device)
    br, bk = (16, 64) if interpreting() else (16, 256)
    launch(_group_dequant_kernel, (triton.cdiv(R, br), triton.cdiv(K, bk)), codes, scale_codes, out, R, K,
           codes.stride(0), scale_codes.stride(0), out.stride(0),
           EFMT=E4M3 if element == "e4m3" else E2M1, SFMT=E8M0 if scale == "e8m0" else SCALE_E4M3, G=group,
           BLOCK_R=br, BLOCK_K=bk, num_warps=4)
    return out
