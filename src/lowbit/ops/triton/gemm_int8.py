"""W8A8 int8 GEMM with the dequantization epilogue fused: out = (acc - za * colsum) * sa * sw + bias.

The contraction is exact integer arithmetic (int8 x int8 products accumulated in int32 by
`tl.dot(..., out_dtype=tl.int32)`), so every bit of error in the output comes from the
quantizer and from the few fp32 roundings of the epilogue, in this fixed order:
    acc_f = fp32(acc)                     (exact while |acc| <= 2**24, else one rounding)
    y     = (acc_f * sa[m]) * sw[n]       (two fp32 roundings)
    y     = y + bias[n]                   (one fp32 rounding, if a bias is given)
    out   = y.to(out_dtype)               (one rounding to bf16/fp16, none for fp32)
On the GPU the last two steps are one FMA, y = fma(acc_f * sa[m], sw[n], bias[n]) (Triton's
default fp fusion contracts the multiply and the add; the H200 output matched exactly that,
tests/ops/test_epilogue_order.py); without a bias, and in Triton's interpreter, they round twice.
With an asymmetric activation (zero point za per row) the correction za * colsum[n] is taken in
int64 before the conversion, so it is exact too. Weights are K-major ([N, K]), symmetric.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (add_bias, check_bias, check_matrix, check_operands, check_out_dtype, check_vector,
                     kmajor_ptrs, launch, mainloop, pick_config, prepare_launch, rowcol_scale, store_tile, swizzled_tile,
                     tile_offsets)

_INT32_LIMIT = 2**31


@triton.jit
def _int8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, za_ptr, colsum_ptr, bias_ptr, pid_m, pid_n,
               M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb, stride_za,
               HAS_SCALES: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
               USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: the int32 contraction, then the epilogue in the module docstring's order."""
    acc = mainloop(a_ptr, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_am, stride_bn,
                   True, False, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_m, offs_n, m_ok, n_ok = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    c_ptrs = kmajor_ptrs(c_ptr, offs_m, stride_cm, offs_n)
    if HAS_SCALES:
        if HAS_ZP:
            za = tl.load(za_ptr + offs_m * stride_za, mask=m_ok, other=0).to(tl.int64)
            cs = tl.load(colsum_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
            accf = (acc.to(tl.int64) - za[:, None] * cs[None, :]).to(tl.float32)
        else:
            accf = acc.to(tl.float32)
        y = rowcol_scale(accf, offs_m, offs_n, m_ok, n_ok, sa_ptr, sb_ptr, stride_sa, stride_sb)
        y = add_bias(y, offs_n, n_ok, bias_ptr, HAS_BIAS)
    else:
        y = acc  # the raw int32 accumulator (no bias: the host refuses one)
    store_tile(c_ptrs, y, m_ok, n_ok)


@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, za_ptr, colsum_ptr, bias_ptr,
                      M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb, stride_za,
                      HAS_SCALES: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                      PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr):
    if PERSISTENT:
        # One program per SM walks the tiles; the flattened loop lets the pipeliner prefetch the
        # next tile's operands during this tile's epilogue.
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _int8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, za_ptr, colsum_ptr, bias_ptr, pid_m, pid_n,
                       M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb, stride_za,
                       HAS_SCALES, HAS_ZP, HAS_BIAS, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _int8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, za_ptr, colsum_ptr, bias_ptr, pid_m, pid_n,
                   M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb, stride_za,
                   HAS_SCALES, HAS_ZP, HAS_BIAS, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)


def check_int8_k(K: int, asymmetric: bool) -> None:
    """int32 accumulation is exact only while K * max|qa| * max|qw| < 2**31."""
    qa = 128 if asymmetric else 127  # asymmetric int8 codes span [-128, 127]
    if K * qa * 127 >= _INT32_LIMIT:
        raise ValueError(f"K={K} is too large for exact int32 accumulation of int8 products "
                         f"(K*{qa}*127 = {K * qa * 127} >= 2**31); split K into chunks of at most "
                         f"{(_INT32_LIMIT - 1) // (qa * 127)} and sum the partial outputs in fp32")


def int8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None = None,
              b_scale: torch.Tensor | None = None, *, a_zero: torch.Tensor | None = None,
              b_colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] (K-major weights) -> [M, N].

    a_scale: fp32 [M] (per token) or [1] (per tensor); b_scale: fp32 [N] or [1] (per channel /
    tensor). a_zero: int32 [M] activation zero points (asymmetric activations; needs
    b_colsum = int32 [N] sums of the weight codes over K). bias: [N], added in fp32.
    out_dtype: bf16 / fp16 / fp32, or torch.int32 with no scales for the raw accumulator.
    config: override the launch configuration (tests use it to force several tile shapes).
    """
    check_matrix("a", a, (torch.int8,))
    check_matrix("b", b, (torch.int8,))
    M, N, K = check_operands(a, b)
    raw = out_dtype == torch.int32
    if raw:
        if any(t is not None for t in (a_scale, b_scale, a_zero, b_colsum, bias)):
            raise ValueError("out_dtype=torch.int32 returns the raw accumulator: pass no scales, "
                             "zero points or bias")
    else:
        check_out_dtype(out_dtype)
        if a_scale is None or b_scale is None:
            raise ValueError("a_scale and b_scale are required unless out_dtype=torch.int32")
    if (a_zero is None) != (b_colsum is None):
        raise ValueError("a_zero and b_colsum go together: the zero-point correction subtracts "
                         "a_zero[m] * b_colsum[n]; compute b_colsum = b.sum(1, dtype=torch.int32)")
    check_int8_k(K, asymmetric=a_zero is not None)
    sa = check_vector("a_scale", a_scale, M, torch.float32)
    sb = check_vector("b_scale", b_scale, N, torch.float32)
    za = check_vector("a_zero", a_zero, M, torch.int32)
    cs = check_vector("b_colsum", b_colsum, N, torch.int32, allow_scalar=False)
    bias = check_bias(bias, N)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        raise ValueError("K must be positive")
    return launch_int8_gemm(a, b, c, sa, sb, za, cs, bias, config)


def launch_int8_gemm(a, b, c, sa, sb, za, cs, bias, config: dict | None = None) -> torch.Tensor:
    """The launch alone, no checks (int8_gemm checks; the prepared runtime checks once, at
    prepare time): operands as int8_gemm's after check_vector, C [M, N] preallocated.
    sa / sb None only for the raw int32 accumulator."""
    M, K = a.shape
    N = b.shape[0]
    cfg = dict(config) if config else pick_config(M, N, K)
    grid, opts, a_arg, b_arg = prepare_launch(cfg, a, b)
    dummy = c  # never read: the constexpr flags switch the loads off
    launch(
        _int8_gemm_kernel, grid, a_arg, b_arg, c,
        sa if sa is not None else dummy, sb if sb is not None else dummy,
        za if za is not None else dummy, cs if cs is not None else dummy,
        bias if bias is not None else dummy,
        M, N, K, a.stride(0), b.stride(0), c.stride(0),
        sa.stride(0) if sa is not None else 0, sb.stride(0) if sb is not None else 0,
        za.stride(0) if za is not None else 0,
        HAS_SCALES=sa is not None, HAS_ZP=za is not None, HAS_BIAS=bias is not None,
        EVEN_K=K % cfg["BLOCK_K"] == 0, **opts)
    return c
