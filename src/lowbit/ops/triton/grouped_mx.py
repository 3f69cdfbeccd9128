"""MXFP8 grouped MoE GEMM (the schedule of lowbit.ops.triton.grouped) reading its e8m0 scales
through the three-index word layouts (lowbit.ops.grouped: four one-byte codes per 32-bit
word along K, byte j % 4 of word group j // 4 for scale group j):
  SFA[g * M_total + m]          A's scales, group-major over the CONCATENATED (sorted) M
  SFB[g * E * N + e * N + n]    B's scales, group-major over (E, N)
A's rows are gathered per token (A is the per-token input [T, K], or the sorted buffer itself),
but its scales are indexed by the sorted row m, as a grouped MX GEMM over the concatenated M reads
them: the launcher lays the per-token codes out in sorted order (sfa_for_tokens).

Arithmetic as lowbit.ops.triton.gemm_blockscaled's MX kernel (Hopper has no MX datapath): each
fp8 tile times its power-of-two scales (gemm_blockscaled._scaled_bf16: exact in bf16 for the
codes lowbit.quantize makes) into the bf16 tensor cores, fp32 accumulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing, scale_words_int32
from lowbit.ops.grouped_configs import GroupedConfig, check_config, grouped_config
from lowbit.ops.triton.common import interpreting, launch
from lowbit.ops.triton.gemm_blockscaled import _bf16_dot, _scaled_bf16
from lowbit.ops.triton.grouped_schedule import check_bias, check_routing, schedule_args, store_rows, tile_rows


@triton.jit
def _word_byte(words, j):
    """Byte j % 4 of each 32-bit word (int32 bit patterns): the e8m0 code of scale group j."""
    return (words >> (8 * (j % 4))) & 0xFF


@triton.jit
def _grouped_mx_kernel(a_ptr, b_ptr, c_ptr, sfa_ptr, sfb_ptr, bias_ptr, off_ptr, tok_ptr,
                       E, N, K, M_total, stride_a, stride_be, stride_bn, stride_c, num_n,
                       HAS_BIAS: tl.constexpr, IDENTITY: tl.constexpr, INTERP: tl.constexpr,
                       BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    NG: tl.constexpr = BLOCK_K // 32
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, E_PAD, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    m64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + tok[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + e * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        j = k0 // 32 + tl.arange(0, NG)                       # scale groups of this K step
        g = (j // 4).to(tl.int64)                             # their word group
        g_ok = j < K // 32
        wa = tl.load(sfa_ptr + g[None, :] * M_total + m64[:, None], mask=valid[:, None] & g_ok[None, :], other=0)
        wb = tl.load(sfb_ptr + g[None, :] * E * N + e * N + offs_n[:, None], mask=n_ok[:, None] & g_ok[None, :],
                     other=0)
        ea = tl.where(g_ok[None, :], _word_byte(wa, j[None, :]), 127)
        eb = tl.where(g_ok[None, :], _word_byte(wb, j[None, :]), 127)
        acc = _bf16_dot(_scaled_bf16(a, ea, BLOCK_M, BLOCK_K), _scaled_bf16(b, eb, BLOCK_N, BLOCK_K), acc, INTERP)
    store_rows(c_ptr, acc, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS)


def sfa_for_tokens(scale_codes: torch.Tensor, routing: Routing, identity: bool = False) -> torch.Tensor:
    """SFA words (int32 bit patterns, flat [ceil(G / 4) * R]) of per-row scale codes uint8 [T, G]
    laid out over the sorted buffer's R rows: row m gets the codes of its token (identity: of row m)."""
    codes = scale_codes if identity else scale_codes[routing.token]
    return scale_words_int32(codes)


def grouped_mxfp8(a_codes: torch.Tensor, sfa: torch.Tensor, w_codes: torch.Tensor, sfb: torch.Tensor,
                  routing: Routing, *, bias=None, identity: bool = False, config: GroupedConfig | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 grouped GEMM: out [R, N] (out_dtype: fp32, bf16 or fp16, one rounding) of sorted row
    m = sum_j (a[token[m], block j] * 2^(SFA_j(m) - 127))
    . (w[e, n, block j] * 2^(SFB_j(e, n) - 127)).
    a_codes [T, K] (the sorted buffer [R, K] with identity), w_codes [E, N, K]: float8_e4m3fn or
    uint8 e4m3fn bit patterns, K a multiple of 32; sfa: the flat SFA words [ceil(K / 128) * R]
    (sfa_for_tokens); sfb: the flat SFB words [ceil(K / 128) * E * N] (lowbit.ops.grouped.sfb_words);
    both uint32 or their int32 bit patterns. config: tiles / warps / stages (lowbit.ops.grouped_configs;
    None: grouped_config's), block_k a multiple of 32."""
    a = a_codes.view(torch.float8_e4m3fn) if a_codes.dtype == torch.uint8 else a_codes
    w = w_codes.view(torch.float8_e4m3fn) if w_codes.dtype == torch.uint8 else w_codes
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"a_codes and w_codes must be float8_e4m3fn (or uint8 bit patterns), got "
                        f"{a_codes.dtype} and {w_codes.dtype}")
    if a.ndim != 2 or w.ndim != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"a_codes must be [T, K] and w_codes [E, N, K] with the same K, got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")
    T, K = a.shape
    E, N, _ = w.shape
    check_routing(routing, T, E, identity)
    c = config or grouped_config("mxfp8", E, N, K, routing.rows)
    check_config("mxfp8", c, K)
    if K % 32 or c.block_k % 32:
        raise ValueError(f"K = {K} and block_k = {c.block_k} must be multiples of the MX block 32")
    R, G4 = routing.rows, -(-K // 128)
    words = []
    for name, t, n in (("sfa", sfa, G4 * R), ("sfb", sfb, G4 * E * N)):
        if t.dtype not in (torch.uint32, torch.int32) or t.numel() != n:
            raise ValueError(f"{name} must be the flat group-major words, uint32 / int32 [{n}] (ceil(K / 128) = {G4} "
                             f"word groups), got {t.dtype} {tuple(t.shape)}")
        words.append(t.reshape(-1).view(torch.int32).contiguous())
    b = check_bias(bias, E, N, a.device)
    ac, wc = a.contiguous(), w.contiguous()
    off, tok, tiles, e_pad = schedule_args(routing, c.block_m, identity)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype={out_dtype}; choose float32, bfloat16 or float16")
    out = torch.zeros(R, N, dtype=out_dtype, device=a.device)
    num_n = triton.cdiv(N, c.block_n)
    launch(_grouped_mx_kernel, (tiles * num_n,), ac, wc, out, words[0], words[1], out if b is None else b, off,
           tok, E, N, K, R, ac.stride(0), wc.stride(0), wc.stride(1), out.stride(0),
           num_n, HAS_BIAS=b is not None, IDENTITY=identity, INTERP=interpreting(),
           BLOCK_M=c.block_m, E_PAD=e_pad, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
           num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def sfb_for_experts(scale_codes: torch.Tensor) -> torch.Tensor:
    """SFB words (int32 bit patterns, flat [ceil(G / 4) * E * N]) of stacked expert scale codes
    uint8 [E, N, G]: word g * E * N + e * N + n (sfb_words' layout)."""
    E, N, G = scale_codes.shape
    return scale_words_int32(scale_codes.reshape(E * N, G))
