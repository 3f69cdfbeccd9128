"""FP8 (e4m3fn) W8A8 GEMM with row-wise or tensor-wise fp32 scales, fp32 accumulation, and the
scale / bias epilogue fused: out = (acc * sa[m]) * sb[n] + bias[n].

Row-wise means one scale per token (row of A) and one per output channel (row of B, stored
[N, K], K-major); tensor-wise is the same kernel with a single scale broadcast. Mixed (per-token
activations, per-tensor weights) works the same way.

Accumulation: on sm_90 Triton by default lets the fp8 tensor-core MMA accumulate with reduced
precision for the whole K loop. `precise=True` (the default) promotes the partial sum into the
fp32 accumulator after every min(BLOCK_K, 128) products (`max_num_imprecise_acc`), the interval
DeepSeek-V3 uses and the counterpart of cuBLAS's `torch._scaled_mm(..., use_fast_accum=False)`;
benchmarks compare like with like (precise=False against use_fast_accum=True).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (bias_store_tile, check_bias, check_matrix, check_operands, check_out_dtype, check_vector,
                     launch, mainloop, pick_config, prepare_launch, rowcol_scale, swizzled_tile, tile_offsets)

FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


@triton.jit
def _fp8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
              M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb,
              HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr):
    """One output tile: the fp32-accumulated contraction, then (acc * sa[m]) * sb[n] + bias[n]."""
    acc = mainloop(a_ptr, b_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, K, stride_am, stride_bn,
                   False, PRECISE, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_K)
    offs_m, offs_n, m_ok, n_ok = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    y = rowcol_scale(acc, offs_m, offs_n, m_ok, n_ok, sa_ptr, sb_ptr, stride_sa, stride_sb)
    bias_store_tile(y, offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS)


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
                     M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb,
                     HAS_BIAS: tl.constexpr, PRECISE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                     PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr, PROMOTE_K: tl.constexpr):
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _fp8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
                      M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb,
                      HAS_BIAS, PRECISE, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_K)
    else:
        pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _fp8_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
                  M, N, K, stride_am, stride_bn, stride_cm, stride_sa, stride_sb,
                  HAS_BIAS, PRECISE, USE_TMA, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PROMOTE_K)


def as_fp8(name: str, t: torch.Tensor) -> torch.Tensor:
    """Accept fp8 e4m3fn tensors or their uint8 bit patterns (QTensor.codes) without copying."""
    check_matrix(name, t, FP8_DTYPES)
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, *,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             precise: bool = True, config: dict | None = None) -> torch.Tensor:
    """fp8 e4m3fn [M, K] x [N, K] (K-major weights) -> [M, N] in out_dtype.

    a / b: torch.float8_e4m3fn or uint8 e4m3fn bit patterns. a_scale: fp32 [M] or [1];
    b_scale: fp32 [N] or [1]. bias: [N], added in fp32. precise: see the module docstring.
    """
    a = as_fp8("a", a)
    b = as_fp8("b", b)
    M, N, K = check_operands(a, b)
    if K == 0:
        raise ValueError("K must be positive")
    check_out_dtype(out_dtype)
    sa = check_vector("a_scale", a_scale, M, torch.float32)
    sb = check_vector("b_scale", b_scale, N, torch.float32)
    if sa is None or sb is None:
        raise ValueError("a_scale and b_scale are required (fp32, one per row or one per tensor)")
    bias = check_bias(bias, N)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    return launch_fp8_gemm(a, b, c, sa, sb, bias, precise, config)


def launch_fp8_gemm(a, b, c, sa, sb, bias, precise: bool = True, config: dict | None = None) -> torch.Tensor:
    """The launch alone, no checks (fp8_gemm checks; the prepared runtime checks once, at
    prepare time): a / b float8_e4m3fn [M, K] / [N, K], sa / sb fp32 vectors, C preallocated."""
    M, K = a.shape
    N = b.shape[0]
    cfg = dict(config) if config else pick_config(M, N, K, kind="fp8")
    precise = cfg.pop("PRECISE", precise)
    grid, opts, a_arg, b_arg = prepare_launch(cfg, a, b)
    launch(
        _fp8_gemm_kernel, grid, a_arg, b_arg, c, sa, sb, bias if bias is not None else c,
        M, N, K, a.stride(0), b.stride(0), c.stride(0), sa.stride(0), sb.stride(0),
        HAS_BIAS=bias is not None, PRECISE=precise, EVEN_K=K % cfg["BLOCK_K"] == 0,
        PROMOTE_K=min(cfg["BLOCK_K"], 128), **opts)
    return c
