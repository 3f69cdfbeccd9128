"""Grouped MoE GEMMs in one launch for all experts: the tile schedule and the W8A8 kernels
(int8 x int8, fp8 e4m3 x fp8 e4m3). The weight-only kernels (int8, int4, MXFP4, NVFP4 weights)
are in lowbit.ops.triton.grouped_w, MXFP8 with its SFA / SFB words in grouped_mx.

Schedule (the idea of vLLM's fused MoE, written here from lowbit's own Routing): each expert's
rows of the sorted token buffer (lowbit.ops.grouped) are cut into BLOCK_M tiles. The grid has a
STATIC number of tiles, max_tiles(R, E, BLOCK_M) = min(R, (R + E * (BLOCK_M - 1)) // BLOCK_M) >= sum_e
ceil(count_e / BLOCK_M) (a live tile holds at least one row), depending only on the buffer's capacity R, E and BLOCK_M (no host
synchronisation: a CUDA graph or torch.compile captures it). Each program finds its tile's expert
(or that it is unused) and first sorted row from the expert offsets itself
(grouped_schedule.tile_rows: a running sum of the experts' tile counts), so no schedule is built
before the launch. A program
computes one (tile, BLOCK_N columns) block: an unused tile runs zero K steps and stores nothing;
a live tile's rows are row0 + [0, BLOCK_M), valid below its expert's end offsets[e + 1] (the
padding of an expert's last tile is masked on load and on store). It gathers the activations of
its rows' tokens (A is the per-token input [T, K], never a materialized sorted copy), multiplies
by its expert's weight [N, K] and writes the sorted rows it owns. The output is zero-filled, so
rows of the buffer that belong to no expert (dropped slots of lowbit.ops.grouped.route_fixed)
read as zeros.

Tiles, warps and stages come from a GroupedConfig (lowbit.ops.grouped_configs; None: its
grouped_config, the registered tuning table or the heuristic).

int8 epilogue order (as lowbit.ops.triton.gemm_int8): acc int32 exact (K * 127 * 127 < 2^31),
then y = (fp32(acc) * sa[token]) * sw[e, n] (+ bias[e, n]), each an fp32 rounding, then one
rounding to the output dtype (fp32 by default; bf16 / fp16 on request, round to nearest even).
fp8 (as lowbit.ops.triton.gemm_fp8): fp8 x fp8 products accumulated in fp32 (on sm_90 the
tensor cores' partial sums are promoted into the fp32 accumulator every BLOCK_K <= 128
products), then the same epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing
from lowbit.ops.grouped_configs import GroupedConfig, check_config, grouped_config
from lowbit.ops.triton.common import launch
from lowbit.ops.triton.grouped_schedule import (check_bias, check_routing, max_tiles,  # noqa: F401
                                                schedule_args, store_rows, tile_rows)
from lowbit.ops.triton.grouped_w import OUT_DTYPES, grouped_w4a16, grouped_w8a16  # noqa: F401  (one import path)

_INT32_LIMIT = 2 ** 31


@triton.jit
def _grouped_w8a8_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, off_ptr, tok_ptr,
                         E, N, K, stride_a, stride_be, stride_bn, stride_c, num_n,
                         INT: tl.constexpr, RAW: tl.constexpr, HAS_BIAS: tl.constexpr, IDENTITY: tl.constexpr,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PROMOTE_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, E_PAD, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a_ptrs = a_ptr + tok[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
        a_mask = valid[:, None] & k_ok[None, :]
        b_mask = k_ok[:, None] & n_ok[None, :]
        if INT:
            a = tl.load(a_ptrs, mask=a_mask, other=0)
            b = tl.load(b_ptrs, mask=b_mask, other=0)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            # fp8: the tensor cores' partial sum promoted into fp32 every PROMOTE_K products (one
            # 32-wide MMA step): the accumulation check_grouped_linear's gate assumes; promoting only
            # once per 128-wide K tile failed it on the H200 (named accumulator_narrower_than_promised)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
    if RAW:
        tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :], acc,
                 mask=valid[:, None] & n_ok[None, :])
    else:
        sa = tl.load(sa_ptr + tok, mask=valid, other=0.0)
        sb = tl.load(sb_ptr + e * N + offs_n, mask=n_ok, other=0.0)
        y = (acc.to(tl.float32) * sa[:, None]) * sb[None, :]
        store_rows(c_ptr, y, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS)


# ---------------------------------------------------------------------- launching
def _w8a8(a, sa, w, sb, routing, bias, raw, identity, config, out_dtype, integer):
    T, K = a.shape
    E, N, _ = w.shape
    check_routing(routing, T, E, identity)
    kind = "int8" if integer else "fp8"
    c = config or grouped_config(kind, E, N, K, routing.rows)
    check_config(kind, c, K)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}; choose one of {OUT_DTYPES}")
    sa = sa.reshape(-1).to(torch.float32).contiguous()
    sb = sb.reshape(E, N).to(torch.float32).contiguous()
    if sa.numel() != T:
        raise ValueError(f"a_scale must hold one scale per row of a ({T}), got {sa.numel()}; per-tensor "
                         "activation scales: expand them to [T]")
    b = check_bias(bias, E, N, a.device)
    off, tok, tiles, e_pad = schedule_args(routing, c.block_m, identity)
    out = torch.zeros(routing.rows, N, dtype=torch.int32 if raw else out_dtype, device=a.device)
    num_n = triton.cdiv(N, c.block_n)
    launch(_grouped_w8a8_kernel, (tiles * num_n,), a, w, out, sa, sb, b if b is not None else sb, off, tok,
           E, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0), num_n,
           INT=integer, RAW=raw, HAS_BIAS=b is not None, IDENTITY=identity,
           BLOCK_M=c.block_m, E_PAD=e_pad, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
           PROMOTE_K=min(c.block_k, 32), num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def grouped_int8(a_codes: torch.Tensor, a_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                 routing: Routing, *, bias=None, raw: bool = False, identity: bool = False,
                 config: GroupedConfig | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W8A8 int8 grouped GEMM: out [R, N] (out_dtype; int32 accumulators when raw; R = routing.rows)
    of sorted row r = a_codes[token[r]] . w_codes[e] with the epilogue of the module docstring.
    a_codes int8 [T, K] (per-token symmetric codes), a_scale fp32 [T] (or [T, 1]);
    w_codes int8 [E, N, K], w_scale fp32 [E, N] (or [E, N, 1]); bias [E, N] or None.
    identity: a_codes is the sorted buffer itself (row r is row r: the second GEMM of an MoE).
    config: tiles / warps / stages (lowbit.ops.grouped_configs; None: grouped_config's)."""
    if a_codes.dtype != torch.int8 or w_codes.dtype != torch.int8:
        raise TypeError(f"a_codes and w_codes must be int8, got {a_codes.dtype} and {w_codes.dtype}")
    _check_shapes(a_codes, w_codes)
    if a_codes.shape[1] * 127 * 127 >= _INT32_LIMIT:
        raise ValueError(f"K = {a_codes.shape[1]} overflows the exact int32 accumulator (K * 127^2 >= 2^31): split K")
    return _w8a8(a_codes.contiguous(), a_scale, w_codes.contiguous(), w_scale, routing, bias, raw, identity,
                 config, out_dtype, True)


def grouped_fp8(a_codes: torch.Tensor, a_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                routing: Routing, *, bias=None, identity: bool = False, config: GroupedConfig | None = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W8A8 fp8 e4m3fn grouped GEMM: out [R, N] (out_dtype) of sorted row r = (sum_k a[token[r], k] *
    w[e, n, k] in fp32) * a_scale[token[r]] * w_scale[e, n] (+ bias[e, n]).
    a_codes [T, K], w_codes [E, N, K]: torch.float8_e4m3fn or uint8 e4m3fn bit patterns;
    a_scale fp32 [T] (per token); w_scale fp32 [E, N] (per expert, per channel)."""
    a, w = _as_fp8("a_codes", a_codes), _as_fp8("w_codes", w_codes)
    _check_shapes(a, w)
    return _w8a8(a.contiguous(), a_scale, w.contiguous(), w_scale, routing, bias, False, identity,
                 config, out_dtype, False)


def _as_fp8(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.view(torch.float8_e4m3fn)
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name} must be torch.float8_e4m3fn or uint8 e4m3fn bit patterns, got {t.dtype}")
    return t


def _check_shapes(a: torch.Tensor, w: torch.Tensor) -> None:
    if a.ndim != 2 or w.ndim != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"a_codes must be [T, K] and w_codes [E, N, K] with the same K, got "
                         f"{tuple(a.shape)} and {tuple(w.shape)}")

