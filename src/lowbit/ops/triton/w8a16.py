"""W8A16: int8 weights (one fp32 scale per output channel), bf16 / fp16 activations.

    out[m, n] = (sum_k x[m, k] * q[n, k]) * s[n] (+ bias[n])

The weight codes are converted to the activation dtype inside the tile (int8 values are
exact in bf16 and fp16), multiplied on the tensor cores with float32 accumulation, and the
per-channel scale is applied once in the epilogue -- the same arithmetic as the float64
reference up to float32 accumulation and these roundings, in this order:
    y = acc * s[n]            (one fp32 rounding)
    y = y + bias[n]           (one fp32 rounding, if a bias is given)
    out = y.to(out_dtype)     (one rounding to bf16 / fp16)
Nothing of the weight is ever dequantized to memory: the GPU holds 1 byte per weight.
Weights are K-major ([N, K]); every M runs through this one kernel with per-M-bucket tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import bias_store_tile, interpreting, kmajor_ptrs, launch, swizzled_tile, tile_offsets


@triton.jit
def _w8a16_kernel(a_ptr, b_ptr, c_ptr, sb_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                  HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m, offs_n, m_ok, n_ok = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N are clamped (never stored): unmasked rows keep the loads vectorised
    a_ptrs = kmajor_ptrs(a_ptr, tl.where(m_ok, offs_m, 0), stride_am, offs_k)
    b_ptrs = kmajor_ptrs(b_ptr, tl.where(n_ok, offs_n, 0), stride_bn, offs_k)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k[None, :] < K - k0
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0)
        if INTERP:  # the interpreter has no bf16 dot: widen both (exact)
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            acc = tl.dot(a, tl.trans(b.to(a.dtype)), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sb = tl.load(sb_ptr + offs_n, mask=n_ok, other=0.0)
    bias_store_tile(acc * sb[None, :], offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS)


def pick_config_w8a16(M: int, N: int, K: int) -> dict:
    """Tiles per M bucket (H100/H200-class; reasoned, then checked by `lowbit bench model`):
    small M streams the weights with many narrow column blocks (one program per ~SM), large M
    uses 128x128 tensor-core tiles."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=1)
    if M <= 16:
        bn = 64 if triton.cdiv(N, 64) >= 132 else 32
        return dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 256:
        return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def w8a16_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16 (unit stride along K), q [N, K] int8 contiguous, scale fp32 [N]
    contiguous, bias [N] or None -> out [M, N] in x's dtype. No argument checks: callers
    (lowbit.ops.prepared) check once at prepare time."""
    M, K = x.shape
    N = q.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    cfg = dict(config) if config else pick_config_w8a16(M, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    launch(_w8a16_kernel, grid, x, q, out, scale, bias if bias is not None else scale, M, N, K,
                        x.stride(0), q.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                        EVEN_K=K % cfg["BLOCK_K"] == 0, INTERP=interpreting(), **cfg)
    return out
