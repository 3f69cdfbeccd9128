"""W8A8 at decode sizes in one launch: the per-token activation quantization in the GEMM's prologue.

For M <= 16 rows, each program (one BLOCK_N slice of the output, all M rows) first finds every row's
absolute maximum over K, then, in the K loop, quantizes its tile of x to the codes the per-token
quantizer (lowbit.ops.triton.act_quant: common.nonzero_quotient, sym_codes: lowbit.quantize's arithmetic, bit for
bit) writes and takes the 8-bit dot with the weights: int8 x int8 in int32 (exact), or e4m3 x e4m3 in
fp32 with the partial sums promoted every min(BLOCK_K, 128) products (as lowbit.ops.triton.gemm_fp8's
precise mode). The epilogue is the two-launch path's: (acc * s[m]) * sw[n] (+ bias[n]), then the output
dtype. So its output is the two-launch path's (act_quant + int8_gemm / fp8_gemm) bit for bit; what it
saves is a launch and the codes' round trip through memory, for x read again by every program (M x K
values from L2: small while M is). Symmetric per-token activations only; weights per channel or tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .act_quant import sym_codes
from .common import bias_store_tile, kmajor_ptrs, launch, nonzero_quotient, pick_config

MAX_M = 16


@triton.jit
def _w8a8_small_kernel(x_ptr, b_ptr, c_ptr, sb_ptr, bias_ptr, M, N, K, stride_xm, stride_bn, stride_cm, stride_sb,
                       FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PROMOTE_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_ptrs = kmajor_ptrs(x_ptr, tl.where(m_ok, offs_m, 0), stride_xm, offs_k)
    b_ptrs = kmajor_ptrs(b_ptr, tl.where(n_ok, offs_n, 0), stride_bn, offs_k)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):     # the rows' ranges (rows past M read as 0: scale 1, codes 0)
        ok = m_ok[:, None] & (offs_k[None, :] < K - k0)
        x = tl.load(x_ptrs + k0, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    s = nonzero_quotient(amax, 448.0 if FP8 else 127.0)      # act_quant's per-token scale
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k[None, :] < K - k0
        x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok, other=0.0).to(tl.float32)
        a = sym_codes(x, s[:, None], FP8)
        if FP8:
            b = tl.load(b_ptrs + k0, mask=k_ok, other=0.0)
            acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b), acc, max_num_imprecise_acc=PROMOTE_K)
        else:
            b = tl.load(b_ptrs + k0, mask=k_ok, other=0)
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    sb = tl.load(sb_ptr + offs_n * stride_sb, mask=n_ok, other=0.0)
    y = (acc.to(tl.float32) * s[:, None]) * sb[None, :]      # gemm_int8 / gemm_fp8's rowcol_scale order
    bias_store_tile(y, offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS)


def small_m_config(M: int, N: int, K: int) -> dict:
    """The default tiles: one MAX_M-row tile covers M; BLOCK_N, warps and stages pick_config's for decode (as many
    programs as SMs stream the weights); BLOCK_K 128, the fp8 promotion interval."""
    c = pick_config(M, N, K)
    return dict(BLOCK_N=c["BLOCK_N"], BLOCK_K=128, num_warps=c["num_warps"], num_stages=c["num_stages"])


def launch_w8a8_small(x2: torch.Tensor, w: torch.Tensor, out: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """out [M, N] = the per-token W8A8 product of float x2 [M, K] (M <= MAX_M, unit stride along K) with int8 or
    float8_e4m3fn weights w [N, K] and fp32 scales w_scale [N] (stride 0: one tensor-wise scale); no checks (the
    prepared runtime checks at prepare time). config: BLOCK_N / BLOCK_K / num_warps / num_stages (small_m_config's
    keys)."""
    M, K = x2.shape
    N = w.shape[0]
    cfg = small_m_config(M, N, K) if not config else {k: config[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps",
                                                                            "num_stages")}
    fp8 = w.dtype == torch.float8_e4m3fn
    launch(_w8a8_small_kernel, (triton.cdiv(N, cfg["BLOCK_N"]),), x2, w, out, w_scale,
           bias if bias is not None else out, M, N, K, x2.stride(0), w.stride(0), out.stride(0),
           w_scale.stride(0),
           FP8=fp8, HAS_BIAS=bias is not None, BLOCK_M=MAX_M, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
           PROMOTE_K=min(cfg["BLOCK_K"], 128), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
