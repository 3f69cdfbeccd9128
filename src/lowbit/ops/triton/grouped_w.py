"""Weight-only grouped MoE GEMMs (the schedule of lowbit.ops.triton.grouped): float activations
times per-expert int8, int4, MXFP4 or NVFP4 weights, fp32 accumulation with IEEE products (no TF32).

4-bit weights are packed two per byte along K (lowbit.packing.pack_int4 / pack_fp4: element 2j
in the low nibble). Each K step multiplies the even and odd columns of A by the low / high
nibbles' weights:
  int4 (WFMT 0)   (sign-extended nibble - zero point) * the group's fp32 scale (one fp32 rounding);
  MXFP4 / NVFP4   e2m1 value * the group's scale code decoded by lowbit.ops.triton.w4a16's
  (WFMT 2 / 3)    block_scale (e8m0 / e4m3), exact (2 x 1 or 4 significant bits); NVFP4's
                  per-expert tensor scale multiplies the fp32 accumulator once at the end
                  (QTensor's effective scale float32(e4m3 * g) differs by <= 2^-24 relative).
  int8 (W8A16)    codes as fp32, the accumulator times the per-channel scale at the end.
The group of a nibble is read per byte, (2 * byte) // GROUP, so any even group size works with
any BLOCK_K (scales are gathered from [E, N, K / GROUP], stride-aware).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing
from lowbit.ops.triton.grouped_schedule import check_bias, check_routing, schedule_args, store_rows, tile_rows
from lowbit.ops.triton.w4a16.codes import W_INT4, W_MXFP4, W_NVFP4, _e2m1_value, block_scale

WFMTS = {"int4": W_INT4, "mxfp4": W_MXFP4, "nvfp4": W_NVFP4}
GROUPS = {"mxfp4": 32, "nvfp4": 16}


@triton.jit
def _grouped_w4_kernel(a_ptr, b_ptr, c_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, bexp_ptr, brow_ptr, off_ptr, tok_ptr,
                       E, N, K, stride_a, stride_be, stride_bn, stride_se, stride_sn, stride_c, num_n, GROUP,
                       WFMT: tl.constexpr, HAS_Z: tl.constexpr, HAS_G: tl.constexpr, HAS_BIAS: tl.constexpr,
                       IDENTITY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(bexp_ptr, brow_ptr, off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + tok[:, None] * stride_a
    for k0 in range(0, k_end, BLOCK_K):
        kb = k0 // 2 + half                                     # byte index along K
        kb_ok = kb < K // 2
        a_mask = valid[:, None] & kb_ok[None, :]
        a_even = tl.load(a_base + 2 * kb[None, :], mask=a_mask, other=0.0).to(tl.float32)
        a_odd = tl.load(a_base + 2 * kb[None, :] + 1, mask=a_mask, other=0.0).to(tl.float32)
        w_mask = kb_ok[:, None] & n_ok[None, :]
        p = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + kb[:, None], mask=w_mask,
                    other=0).to(tl.int32)
        s_idx = e * stride_se + offs_n[None, :] * stride_sn + ((2 * kb) // GROUP)[:, None]
        if WFMT == 0:
            s = tl.load(s_ptr + s_idx, mask=w_mask, other=0.0)
            lo = ((p & 0xF) ^ 8) - 8                            # sign-extend the low nibble
            hi = ((p >> 4) ^ 8) - 8
            if HAS_Z:
                z = tl.load(z_ptr + s_idx, mask=w_mask, other=0).to(tl.int32)
                lo = lo - z
                hi = hi - z
            w_lo = lo.to(tl.float32) * s
            w_hi = hi.to(tl.float32) * s
        else:
            bs = block_scale(tl.load(s_ptr + s_idx, mask=w_mask, other=127).to(tl.int32), WFMT)
            w_lo = _e2m1_value(p & 15) * bs
            w_hi = _e2m1_value(p >> 4) * bs
        acc += tl.dot(a_even, w_lo, input_precision="ieee")
        acc += tl.dot(a_odd, w_hi, input_precision="ieee")
    if HAS_G:
        acc = acc * tl.load(g_ptr + e)
    store_rows(c_ptr, acc, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS)


@triton.jit
def _grouped_w8a16_kernel(a_ptr, b_ptr, c_ptr, s_ptr, bias_ptr, bexp_ptr, brow_ptr, off_ptr, tok_ptr,
                          E, N, K, stride_a, stride_be, stride_bn, stride_c, num_n,
                          HAS_BIAS: tl.constexpr, IDENTITY: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(bexp_ptr, brow_ptr, off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + tok[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0).to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    y = acc * tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
    store_rows(c_ptr, y, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS)


def _check_x(x: torch.Tensor) -> None:
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float [T, K] (float32 / bfloat16 / float16), got {x.dtype} {tuple(x.shape)}")


def grouped_w4a16(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *,
                  group_size: int | None = None, kind: str = "int4", w_zero: torch.Tensor | None = None,
                  w_global: torch.Tensor | None = None, bias=None, identity: bool = False, block_m: int = 16,
                  block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """Weight-only 4-bit grouped GEMM: out fp32 [R, N] of sorted row r = x[token[r]] . dequant(w[e]).

    x [T, K] fp32 / bf16 / fp16 (the sorted buffer itself with identity=True);
    w_packed uint8 [E, N, K / 2] (pack_int4 of signed int4 codes, or pack_fp4 of e2m1 codes);
    kind "int4": w_scale fp32 [E, N, K / group_size], w_zero int [E, N, K / group_size] or None;
    kind "mxfp4" / "nvfp4": w_scale = the uint8 scale codes [E, N, K / 32] (e8m0) / [E, N, K / 16]
    (e4m3); w_global fp32 [E] (NVFP4's per-expert tensor scale, or any per-expert factor that
    multiplies the accumulator), else None."""
    if kind not in WFMTS:
        raise ValueError(f"kind={kind!r}; choose one of {sorted(WFMTS)}")
    if w_packed.dtype != torch.uint8 or w_packed.ndim != 3:
        raise TypeError(f"w_packed must be uint8 [E, N, K / 2] (pack_int4 / pack_fp4), got {w_packed.dtype} "
                        f"{tuple(w_packed.shape)}")
    _check_x(x)
    T, K = x.shape
    E, N, Kh = w_packed.shape
    if Kh * 2 != K:
        raise ValueError(f"w_packed holds K = {2 * Kh} codes per row, x has K = {K}")
    group = GROUPS.get(kind, group_size)
    if group is None or (group_size is not None and group_size != group):
        raise ValueError(f"group_size={group_size} for kind {kind!r}: int4 needs its group size, "
                         f"MXFP4 / NVFP4 use {GROUPS}")
    if K % group or group % 2 or block_k % 2:
        raise ValueError(f"K = {K} must be a multiple of group_size = {group} (even), block_k = {block_k} even")
    if tuple(w_scale.shape) != (E, N, K // group):
        raise ValueError(f"w_scale must be [E, N, K / group_size] = {(E, N, K // group)}, got {tuple(w_scale.shape)}")
    if kind == "int4":
        s = w_scale.to(torch.float32)
    elif w_scale.dtype != torch.uint8:
        raise TypeError(f"{kind}: w_scale must be the uint8 scale codes [E, N, K / {group}], got {w_scale.dtype}")
    else:
        s = w_scale
    if w_zero is not None and (kind != "int4" or tuple(w_zero.shape) != tuple(w_scale.shape)):
        raise ValueError(f"w_zero: int4 zero points shaped like w_scale {tuple(w_scale.shape)}, got "
                         f"{tuple(w_zero.shape)} for kind {kind!r}")
    if w_global is not None and w_global.numel() != E:
        raise ValueError(f"w_global must hold one factor per expert ({E}), got {tuple(w_global.shape)}")
    check_routing(routing, T, E, identity)
    s = s.contiguous()
    z = None if w_zero is None else w_zero.to(torch.int32).contiguous()
    g = None if w_global is None else w_global.reshape(E).to(torch.float32).contiguous()
    b = check_bias(bias, E, N, x.device)
    xc, w = x.contiguous(), w_packed.contiguous()
    bexp, brow, off, tok, tiles = schedule_args(routing, block_m, identity)
    out = torch.zeros(routing.rows, N, dtype=torch.float32, device=x.device)
    num_n = triton.cdiv(N, block_n)
    dummy = out
    _grouped_w4_kernel[(tiles * num_n,)](xc, w, out, s, dummy if z is None else z, dummy if g is None else g,
                                         dummy if b is None else b, bexp, brow, off, tok,
                                         E, N, K, xc.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                                         out.stride(0), num_n, group, WFMT=WFMTS[kind], HAS_Z=z is not None,
                                         HAS_G=g is not None, HAS_BIAS=b is not None, IDENTITY=identity,
                                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def grouped_w8a16(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *, bias=None,
                  identity: bool = False, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """Weight-only int8 grouped GEMM: out fp32 [R, N] of sorted row r = (x[token[r]] . w_codes[e])
    * w_scale[e, n] (+ bias[e, n]). x [T, K] float; w_codes int8 [E, N, K]; w_scale fp32 [E, N]."""
    if w_codes.dtype != torch.int8 or w_codes.ndim != 3:
        raise TypeError(f"w_codes must be int8 [E, N, K], got {w_codes.dtype} {tuple(w_codes.shape)}")
    _check_x(x)
    T, K = x.shape
    E, N, Kw = w_codes.shape
    if Kw != K:
        raise ValueError(f"w_codes has K = {Kw}, x has K = {K}")
    check_routing(routing, T, E, identity)
    s = w_scale.reshape(E, N).to(torch.float32).contiguous()
    b = check_bias(bias, E, N, x.device)
    xc, w = x.contiguous(), w_codes.contiguous()
    bexp, brow, off, tok, tiles = schedule_args(routing, block_m, identity)
    out = torch.zeros(routing.rows, N, dtype=torch.float32, device=x.device)
    num_n = triton.cdiv(N, block_n)
    _grouped_w8a16_kernel[(tiles * num_n,)](xc, w, out, s, out if b is None else b, bexp, brow, off, tok,
                                            E, N, K, xc.stride(0), w.stride(0), w.stride(1), out.stride(0), num_n,
                                            HAS_BIAS=b is not None, IDENTITY=identity,
                                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
