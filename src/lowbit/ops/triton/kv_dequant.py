"""One-launch dequantization of a KV cache operand into a bf16 buffer (the SDPA fallback's input).

    dequantize_bf16_into(kv, out)        kv: KVQuant fp8 e4m3 / int8 scaled per tensor, head or token;
                                         out: bf16 [B, H, T, D] (contiguous), written in place

out = bf16(fp32(decode(code) * scale)): the code's exact value times its fp32 scale, rounded to
fp32 (one IEEE multiply), then rounded to bf16 (RNE) -- bit for bit what
KVQuant.dequantize(torch.float32).to(torch.bfloat16) gives, reading one byte and writing two per
value instead of the torch ops' fp32 round trips.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.kv_quant import KVQuant

from .common import cast_out, check_device, decode_e4m3fn, interpreting, launch

BLOCK_ROWS = 16
_KIND = {"fp8_e4m3fn": 0, "int8": 1}


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, o_ptr, R, H, T, D, sc_b, sc_h, sc_t, ss_b, ss_h, ss_t,
                    KIND: tl.constexpr, FAST_FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)          # row = (b * H + h) * T + t
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < R
    t = rows % T
    bh = rows // T
    b = (bh // H).to(tl.int64)
    h = bh % H
    ok = r_ok[:, None] & (offs_d < D)[None, :]
    raw = tl.load(c_ptr + (b * sc_b + h * sc_h + t * sc_t)[:, None] + offs_d[None, :], mask=ok, other=0)
    if KIND == 0:
        if FAST_FP8:
            val = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            val = decode_e4m3fn(raw.to(tl.int32))
    else:
        val = raw.to(tl.float32)
    s = tl.load(s_ptr + b * ss_b + h * ss_h + t * ss_t, mask=r_ok, other=0.0)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * D + offs_d[None, :], cast_out(val * s[:, None], tl.bfloat16),
             mask=ok)


def supports(kv: KVQuant) -> bool:
    """fp8 e4m3 / int8 codes (one per byte) with one scale per tensor, head or token."""
    return kv.scheme.format in _KIND and kv.scheme.granularity != "group"


def dequantize_bf16_into(kv: KVQuant, out: torch.Tensor) -> torch.Tensor:
    """Write bf16(fp32(decode(code) * scale)) of `kv` into `out` (bf16, contiguous, kv's shape)."""
    if not supports(kv):
        raise ValueError(f"dequantize_bf16_into: {kv.scheme} (fp8_e4m3fn / int8 per tensor, head or token only)")
    B, H, T, D = kv.shape
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (B, H, T, D) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 {(B, H, T, D)} tensor, got {out.dtype} {tuple(out.shape)}")
    check_device("kv.codes", kv.codes)
    if kv.codes.stride(3) != 1:
        raise ValueError("kv.codes must be contiguous along the head dim")
    s = kv.scale_bhtg()[..., 0]
    R = B * H * T
    bd = max(16, triton.next_power_of_2(D))
    launch(_dequant_kernel, (triton.cdiv(R, BLOCK_ROWS),), kv.codes, s, out, R, H, T, D, *kv.codes.stride()[:3],
           *s.stride(), KIND=_KIND[kv.scheme.format], FAST_FP8=not interpreting(), BLOCK_R=BLOCK_ROWS, BLOCK_D=bd,
           num_warps=4)
    return out
