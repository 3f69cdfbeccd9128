"""Grouped MoE GEMMs in one launch for all experts: W8A8 int8 and W4A16 int4.

Schedule (the idea of vLLM's fused MoE, written here from lowbit's own Routing): each expert's
rows of the sorted token buffer (lowbit.ops.grouped) are cut into BLOCK_M tiles; `block_rows`
lists, per tile, its BLOCK_M sorted-row indices (-1 for the padding of an expert's last tile)
and `block_expert` the tile's expert. Empty experts get no tile. A program computes one
(tile, BLOCK_N columns) block: it gathers the activations of its rows' tokens (A is the
per-token input [T, K], never a materialized sorted copy), multiplies by its expert's weight
[N, K] and writes the sorted rows it owns; padding rows are masked on load and on store.

int8 epilogue order (as lowbit.ops.triton.gemm_int8): acc int32 exact (K * 127 * 127 < 2^31),
then y = (fp32(acc) * sa[token]) * sw[e, n] (+ bias[e, n]), each an fp32 rounding.
int4 weights are packed two per byte along K (lowbit.packing.pack_int4: low nibble = even k);
each K step multiplies the even and odd columns of A by the sign-extended low / high nibbles
times the group scale (exact in fp32: a 4-bit code times a float32 scale), accumulating in fp32
with IEEE products (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing

_INT32_LIMIT = 2 ** 31


def block_schedule(routing: Routing, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_rows int32 [tiles * block_m] with -1 padding, block_expert int32 [tiles])."""
    counts = routing.counts().tolist()
    off = routing.offsets.tolist()
    rows, experts = [], []
    for e, c in enumerate(counts):
        tiles = -(-c // block_m)
        if not tiles:
            continue
        r = torch.full((tiles * block_m,), -1, dtype=torch.int32)
        r[:c] = torch.arange(off[e], off[e] + c, dtype=torch.int32)
        rows.append(r)
        experts += [e] * tiles
    dev = routing.offsets.device
    return torch.cat(rows).to(dev), torch.tensor(experts, dtype=torch.int32, device=dev)


@triton.jit
def _grouped_int8_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, rows_ptr, tok_ptr, bexp_ptr,
                         N, K, stride_a, stride_be, stride_bn, stride_c, num_n,
                         RAW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    tok = tl.load(tok_ptr + rows, mask=valid, other=0).to(tl.int64)
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + tok[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0)
        b = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    mask = valid[:, None] & n_ok[None, :]
    if RAW:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        sa = tl.load(sa_ptr + tok, mask=valid, other=0.0)
        sb = tl.load(sb_ptr + e * N + offs_n, mask=n_ok, other=0.0)
        y = (acc.to(tl.float32) * sa[:, None]) * sb[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
        tl.store(c_ptrs, y, mask=mask)


@triton.jit
def _grouped_w4a16_kernel(a_ptr, b_ptr, c_ptr, s_ptr, bias_ptr, rows_ptr, tok_ptr, bexp_ptr,
                          N, K, G, stride_a, stride_be, stride_bn, stride_se, stride_sn, stride_c, num_n, GROUP,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = pid // num_n, pid % num_n
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    tok = tl.load(tok_ptr + rows, mask=valid, other=0).to(tl.int64)
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + half                                     # byte index along K
        kb_ok = kb < K // 2
        a_base = a_ptr + tok[:, None] * stride_a
        a_even = tl.load(a_base + 2 * kb[None, :], mask=valid[:, None] & kb_ok[None, :], other=0.0).to(tl.float32)
        a_odd = tl.load(a_base + 2 * kb[None, :] + 1, mask=valid[:, None] & kb_ok[None, :], other=0.0).to(tl.float32)
        p = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + kb[:, None],
                    mask=kb_ok[:, None] & n_ok[None, :], other=0).to(tl.int32)
        lo = ((p & 0xF) ^ 8) - 8                                # sign-extend the low nibble
        hi = ((p >> 4) ^ 8) - 8
        s = tl.load(s_ptr + e * stride_se + offs_n * stride_sn + k0 // GROUP, mask=n_ok, other=0.0)
        acc += tl.dot(a_even, lo.to(tl.float32) * s[None, :], input_precision="ieee")
        acc += tl.dot(a_odd, hi.to(tl.float32) * s[None, :], input_precision="ieee")
    y = acc
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :], y, mask=valid[:, None] & n_ok[None, :])


def _check_routing(routing: Routing, T: int, E: int) -> None:
    if routing.num_tokens != T:
        raise ValueError(f"routing was made for {routing.num_tokens} tokens, the activations have {T}")
    if routing.num_experts != E:
        raise ValueError(f"routing has {routing.num_experts} experts, the weights {E}")
    if routing.rows == 0:
        raise ValueError("routing has no rows (every slot dropped or a zero-token batch): nothing to compute")


def _bias(bias, E, N, device):
    if bias is None:
        return None
    b = torch.as_tensor(bias)
    if tuple(b.shape) != (E, N):
        raise ValueError(f"bias must be [E = {E}, N = {N}], got {tuple(b.shape)}")
    return b.to(device, torch.float32).contiguous()


def grouped_int8(a_codes: torch.Tensor, a_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                 routing: Routing, *, bias=None, raw: bool = False, block_m: int = 16, block_n: int = 32,
                 block_k: int = 32) -> torch.Tensor:
    """W8A8 grouped GEMM: out [M_total, N] (fp32; int32 accumulators when raw) of sorted row r =
    a_codes[token[r]] . w_codes[e] with the epilogue of the module docstring.
    a_codes int8 [T, K] (per-token symmetric codes), a_scale fp32 [T] (or [T, 1]);
    w_codes int8 [E, N, K], w_scale fp32 [E, N] (or [E, N, 1]); bias [E, N] or None."""
    if a_codes.dtype != torch.int8 or w_codes.dtype != torch.int8:
        raise TypeError(f"a_codes and w_codes must be int8, got {a_codes.dtype} and {w_codes.dtype}")
    if a_codes.ndim != 2 or w_codes.ndim != 3 or a_codes.shape[1] != w_codes.shape[2]:
        raise ValueError(f"a_codes must be [T, K] and w_codes [E, N, K] with the same K, got "
                         f"{tuple(a_codes.shape)} and {tuple(w_codes.shape)}")
    T, K = a_codes.shape
    E, N, _ = w_codes.shape
    if K * 127 * 127 >= _INT32_LIMIT:
        raise ValueError(f"K = {K} overflows the exact int32 accumulator (K * 127^2 >= 2^31): split K")
    _check_routing(routing, T, E)
    sa = a_scale.reshape(-1).to(torch.float32).contiguous()
    sb = w_scale.reshape(E, N).to(torch.float32).contiguous()
    if sa.numel() != T:
        raise ValueError(f"a_scale must hold one scale per token ({T}), got {tuple(a_scale.shape)}; per-tensor "
                         "activation scales: expand them to [T]")
    b = _bias(bias, E, N, a_codes.device)
    a, w = a_codes.contiguous(), w_codes.contiguous()
    rows, bexp = block_schedule(routing, block_m)
    tok = routing.token.to(torch.int32).contiguous()
    out = torch.empty(routing.rows, N, dtype=torch.int32 if raw else torch.float32, device=a.device)
    num_n = triton.cdiv(N, block_n)
    grid = (bexp.numel() * num_n,)
    _grouped_int8_kernel[grid](a, w, out, sa, sb, b if b is not None else sb, rows, tok, bexp,
                               N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0), num_n,
                               RAW=raw, HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def grouped_w4a16(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *,
                  group_size: int, bias=None, block_m: int = 16, block_n: int = 32,
                  block_k: int = 32) -> torch.Tensor:
    """W4A16 grouped GEMM: out fp32 [M_total, N] of sorted row r = x[token[r]] . dequant(w[e]).
    x [T, K] fp32 / bf16 / fp16; w_packed uint8 [E, N, K / 2] (lowbit.packing.pack_int4 of signed
    int4 codes); w_scale fp32 [E, N, K / group_size]; group_size a multiple of block_k."""
    if w_packed.dtype != torch.uint8 or w_packed.ndim != 3:
        raise TypeError(f"w_packed must be uint8 [E, N, K / 2] (pack_int4), got {w_packed.dtype} "
                        f"{tuple(w_packed.shape)}")
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float [T, K], got {x.dtype} {tuple(x.shape)}")
    T, K = x.shape
    E, N, Kh = w_packed.shape
    if Kh * 2 != K:
        raise ValueError(f"w_packed holds K = {2 * Kh} codes per row, x has K = {K}")
    if K % group_size or group_size % block_k or block_k % 2:
        raise ValueError(f"K = {K} must be a multiple of group_size = {group_size}, itself a multiple of "
                         f"block_k = {block_k} (one scale per K step)")
    if tuple(w_scale.shape) != (E, N, K // group_size):
        raise ValueError(f"w_scale must be [E, N, K / group_size] = {(E, N, K // group_size)}, got "
                         f"{tuple(w_scale.shape)}")
    _check_routing(routing, T, E)
    s = w_scale.to(torch.float32).contiguous()
    b = _bias(bias, E, N, x.device)
    xc, w = x.contiguous(), w_packed.contiguous()
    rows, bexp = block_schedule(routing, block_m)
    tok = routing.token.to(torch.int32).contiguous()
    out = torch.empty(routing.rows, N, dtype=torch.float32, device=x.device)
    num_n = triton.cdiv(N, block_n)
    grid = (bexp.numel() * num_n,)
    _grouped_w4a16_kernel[grid](xc, w, out, s, b if b is not None else s, rows, tok, bexp,
                                N, K, K // group_size, xc.stride(0), w.stride(0), w.stride(1), s.stride(0),
                                s.stride(1), out.stride(0), num_n, group_size,
                                HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
