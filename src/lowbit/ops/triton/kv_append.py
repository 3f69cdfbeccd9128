"""Write a decode step's new key or value states into a preallocated quantized KV cache, Triton:
one launch quantizes [B, H, 1, D] states and stores their codes (and, for dynamic per-token
scales, their scales) at a position read from a device tensor, so a CUDA graph can replay the
step at any position. The arithmetic is lowbit.quantize's (fused_quant's _group_scales / _codes:
IEEE division, round half to even, saturation), so the codes equal lowbit.ops.kv_quant.quantize_kv's
bit for bit (tests/ops/test_kv_append.py); done with torch ops the same write costs about ten
small launches per tensor, which at batch 1 cost more than the fp8 cache saves in the attention."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.dispatch import KV_APPEND_DTYPES, kv_append_supports
from lowbit.ops.fused_launch import element_meta
from lowbit.ops.kv_quant import KVQuant

from .common import check_device, interpreting, launch
from .fused_quant import _codes as _quant_codes
from .fused_quant import _group_scales


@triton.jit
def _append_kernel(x_ptr, c_ptr, s_ptr, pos_ptr, bad_ptr, H, D, sx_b, sx_h, sx_d, sc_b, sc_h, sc_t, sc_d, ss_h,
                   ss_t, FMT: tl.constexpr, QMAX: tl.constexpr, DYNAMIC: tl.constexpr, FAST: tl.constexpr,
                   CHECK: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)                       # one (batch, head) row of D values
    b = r // H
    h = r % H
    t = tl.load(pos_ptr).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    y = tl.load(x_ptr + b * sx_b + h * sx_h + offs * sx_d, mask=ok, other=0.0).to(tl.float32)[None, :]
    one = tl.arange(0, 1)
    if CHECK:                                  # |y| <= FLT_MAX is false exactly for NaN and +-Inf
        bad = tl.max(tl.where(tl.abs(y) <= 3.4028234663852886e38, 0, 1), axis=1)
        tl.atomic_min(bad_ptr + one, t * tl.num_programs(0) + r, mask=bad != 0)
    if DYNAMIC:                                # per (token, head): this row's absmax
        s, _ = _group_scales(tl.max(tl.abs(y), axis=1), s_ptr, 0, 0, QMAX, 0, 0, 0)
        tl.store(s_ptr + r * ss_h + t * ss_t + one, s)
    else:                                      # static: per tensor (ss_h = 0) or per head
        s = tl.load(s_ptr + h * ss_h + one)
    # FAST (on the GPU): the FMA division and the hardware fp8 cast, both exact there; the
    # interpreter's FMA is not fused, so it takes IEEE division and the bit-level encoder
    codes = _quant_codes(y, s[:, None], FMT, 0, QMAX, FAST, FAST, STATIC=not DYNAMIC)
    tl.store(c_ptr + b * sc_b + h * sc_h + t * sc_t + offs[None, :] * sc_d, codes, mask=ok[None, :])


def append_kv(cache: KVQuant, x: torch.Tensor, pos: torch.Tensor, bad: torch.Tensor | None = None) -> None:
    """Quantize x [B, H, 1, D] (bf16 / fp16 / fp32) into cache (KVQuant [B, H, T, D], fp8 e4m3 or
    int8, scales per tensor, head or token) at token position pos (an int32 / int64 tensor of one
    element on x's device; 0 <= pos < T is the caller's promise: it is not read on the host), in
    place. Dynamic schemes also write the scale at [:, :, pos].

    NaN/Inf in x is not refused here (a refusal would sync the host every step; quantize_kv is the
    path that raises). With `bad` (an int64 tensor on x's device, set beforehand to a value above
    every row index, e.g. torch.iinfo(torch.int64).max) the kernel records, with no extra launch,
    min(bad[0], pos * B * H + b * H + h) over the (batch b, head h) rows of x holding a NaN/Inf;
    the caller reads it when it may sync (lowbit.nn.kv_cache does)."""
    sch = cache.scheme
    if not kv_append_supports(sch):
        raise ValueError(f"append_kv writes fp8 / int8 caches with scales per tensor, head or token, not {sch}; "
                         "use lowbit.ops.kv_quant.quantize_kv")
    if x.dim() != 4 or x.shape[2] != 1:
        raise ValueError(f"x must be one token's states [B, H, 1, D], got {tuple(x.shape)}")
    B, H, T, D = cache.codes.shape
    if (x.shape[0], x.shape[1], x.shape[3]) != (B, H, D):
        raise ValueError(f"x {tuple(x.shape)} does not fit the cache {tuple(cache.codes.shape)} (B, H, D must agree)")
    if x.dtype not in KV_APPEND_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if not isinstance(pos, torch.Tensor) or pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise TypeError("pos must be an int32 / int64 tensor of one element on the cache's device (a device "
                        "scalar keeps the step graph-replayable)")
    if bad is not None and (not isinstance(bad, torch.Tensor) or bad.dtype != torch.int64 or bad.numel() < 1
                            or bad.device != x.device):
        raise TypeError("bad must be an int64 tensor of at least one element on x's device (or None)")
    for name, t in (("x", x), ("cache.codes", cache.codes), ("cache.scale", cache.scale), ("pos", pos)):
        check_device(name, t)
    fmt, qmax = element_meta(sch.format)
    s = cache.scale
    if sch.dynamic:                                           # [B, H, T, 1]
        ss_h, ss_t = s.stride(1), s.stride(2)
        if s.stride(0) != H * ss_h:
            raise ValueError("cache.scale must have contiguous (batch, head) rows for append_kv")
    else:                                                     # [1, 1, 1, 1] or [1, H, 1, 1]
        ss_h, ss_t = (0 if s.shape[1] == 1 else s.stride(1)), 0
    c = cache.codes
    launch(_append_kernel, (B * H,), x, c, s, pos, pos if bad is None else bad, H, D,
           x.stride(0), x.stride(1), x.stride(3), c.stride(0), c.stride(1), c.stride(2), c.stride(3), ss_h, ss_t,
           FMT=fmt, QMAX=qmax, DYNAMIC=sch.dynamic, FAST=not interpreting(), CHECK=bad is not None,
           BLOCK_D=triton.next_power_of_2(D), num_warps=1)
