"""Weight-only grouped MoE GEMMs (the schedule of lowbit.ops.triton.grouped): float activations
times per-expert int8, int4, MXFP4 or NVFP4 weights on the tensor cores, fp32 accumulation.
Tiles, warps, stages and split-K come from a GroupedConfig (lowbit.ops.grouped_configs).

The dot (lowbit.ops.triton.w4a16.codes._product1): bf16 / fp16 activations as they are, weights
converted to the activation's dtype only where that is exact, fp32 accumulation on the tensor
cores; fp32 activations take IEEE fp32 products (no TF32); Triton's interpreter widens to fp32.
4-bit weights are packed two per byte along K (lowbit.packing.pack_int4 / pack_fp4: element 2j
in the low nibble); a step of S codes loads A's [BM, S] (one contiguous load, split into its even
and odd columns in registers) and multiplies them by the low / high nibbles' weights (two dots of
S / 2); int4 steps of S >= 128 codes (WORDS) read the bytes as int32 words of 8 codes and take each
code with one shift and mask, A split into 8 column planes (eight dots of S / 8), instead of
extracting every byte (the decode tile's sm_90 SASS: 840 instructions instead of 928). PREFETCH (the config's prefetch, else at decode tiles, BLOCK_M <= PREFETCH_MAX_M): the
next step's operands are loaded into registers during the dots; without it Triton's pipeliner
streams the weights through shared memory (cp.async, num_stages deep). The tuning table picks.
  int4 (WFMT 0)   code - zero point (an integer |.| <= 135: exact in bf16 and fp16;
                  w4a16.codes._nibble_value) times A, products exact, summed in fp32 over one
                  scale group (S = group when BLOCK_K >= group: BLOCK_K / group such sums per
                  step; else the group's BLOCK_K steps accumulate in a partial); then
                  acc += partial * scale (one fp32 multiply and one addition per group). Per
                  output: <= group roundings inside a group, 1 scale multiply, K / group additions
                  (lowbit.verify.tolerance.rounding_count's float count for the group gc = group).
  MXFP4 / NVFP4   e2m1 value * the group's block scale (e8m0 / e4m3, w4a16.codes.block_scale):
  (WFMT 2 / 3)    <= 6 significant bits, exact in bf16 (NVFP4 also in fp16; MXFP4 with fp16
                  activations runs the fp32 dot, fp16's range cannot hold every scale), products
                  exact, fp32 sums; NVFP4's per-expert tensor scale multiplies the fp32
                  accumulator once at the end (QTensor's effective scale float32(e4m3 * g)
                  differs by <= 2^-24 relative).
  int8 (W8A16)    codes exact in bf16 / fp16, fp32 sums over K, then times the per-channel scale.
fp4 and int8 sum over all of K in one fp32 accumulator (the tensor cores' chunks of 16 products, as
the previous CUDA-core kernel summed them one by one); int4 sums per group, as the gate counts.
Then (+ bias) and one rounding to the output dtype (fp32 by default; bf16 / fp16 on request).
split_k > 1: each program sums a K range (whole groups) into its own fp32 partial [split, R, N]
(the bias in split 0's), then torch sums the partials over the split axis (a fixed order: the
same bits on every run) and rounds once to the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing
from lowbit.ops.grouped_configs import GroupedConfig, check_config, grouped_config
from lowbit.ops.triton.common import interpreting, launch
from lowbit.ops.triton.grouped_schedule import check_bias, check_routing, schedule_args, store_rows, tile_rows
from lowbit.ops.triton.w4a16.codes import _e2m1_value, _nibble_value, _product1, block_scale
from lowbit.ops.w4_formats import FP4_GROUPS, GROUPED_W4, W4Format, WFMT as WFMT_CODE  # WFMT: the kernels' constexpr

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp4_weights(c, bs, NG: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exact float32 weights of fp4 codes c [NG * L, BN] whose runs of L rows share one block
    scale of bs [NG, BN] (float32)."""
    return tl.reshape(tl.reshape(_e2m1_value(c), (NG, L, BLOCK_N)) * bs[:, None, :], (NG * L, BLOCK_N))


@triton.jit
def _finish(c_ptr, acc, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, pid_k,
            stride_p, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """Store a tile (store_rows), or, split-K, its fp32 partial into split pid_k's slice of the
    partials (stride_p elements apart; the bias by split 0 only)."""
    if PARTIAL:
        if HAS_BIAS:
            b = tl.load(bias_ptr + e * N + offs_n, mask=n_ok & (pid_k == 0), other=0.0)
            acc = acc + b[None, :]
        tl.store(c_ptr + pid_k.to(tl.int64) * stride_p + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :], acc,
                 mask=valid[:, None] & n_ok[None, :])
    else:
        store_rows(c_ptr, acc, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS)


@triton.jit
def _w4_step(a_base, w_base, s_ptr, z_ptr, s_row, valid, n_ok, ks, k_hi, K, WFMT: tl.constexpr, HAS_Z: tl.constexpr,
             GROUP: tl.constexpr, S: tl.constexpr, NG: tl.constexpr, WORDS: tl.constexpr):
    """The operands of the S codes at ks (nothing read past k_hi): A [BM, S] in one contiguous load, split in
    registers into its even and odd columns [BM, S / 2] (WORDS: A whole, twice), the packed bytes [S / 2, BN]
    (int32; WORDS: the int32 words [S / 8, BN], 8 codes each), and the group data: int4 the fp32 scales [BN]
    and zero points [BN] (int32; 0 without HAS_Z); fp4 the scale codes [NG, BN] (int32)."""
    live = ks < k_hi
    ka = ks + tl.arange(0, S)
    a = tl.load(a_base + ka[None, :], mask=valid[:, None] & ((ka < K) & live)[None, :], other=0.0)
    if WORDS:
        a_even, a_odd = a, a
        kw = ks // 8 + tl.arange(0, S // 8)
        p = tl.load(w_base.to(tl.pointer_type(tl.int32)) + kw[:, None],
                    mask=((kw < K // 8) & live)[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
    else:
        a_even, a_odd = tl.split(tl.reshape(a, (a.shape[0], S // 2, 2)))
        kb = ks // 2 + tl.arange(0, S // 2)
        p = tl.load(w_base + kb[:, None], mask=((kb < K // 2) & live)[:, None] & n_ok[None, :], other=0,
                    eviction_policy="evict_first").to(tl.int32)
    if WFMT == 0:
        ok = n_ok & live & (ks < K)
        sv = tl.load(s_ptr + s_row + ks // GROUP, mask=ok, other=0.0)
        if HAS_Z:
            zv = tl.load(z_ptr + s_row + ks // GROUP, mask=ok, other=0)
        else:
            zv = tl.zeros_like(n_ok.to(tl.int32))
    else:
        gi = ks // GROUP + tl.arange(0, NG)
        sv = tl.load(s_ptr + s_row[None, :] + gi[:, None], mask=n_ok[None, :] & ((gi < K // GROUP) & live)[:, None],
                     other=127).to(tl.int32)
        zv = sv
    return a_even, a_odd, p, sv, zv


@triton.jit
def _word_dots(a, pw, off, d, S: tl.constexpr, INTERP: tl.constexpr):
    """d + sum over j of a[:, 8w + j] @ (nibble j of word w - zero point) for A [BM, S] and offset-binary words
    pw [S / 8, BN] (code 8w + j in bits 4j..4j+3): eight dots of S / 8 accumulated into d in fp32, each code's
    value taken from its word with one shift and mask (no per-byte extraction)."""
    a8 = tl.reshape(a, (a.shape[0], S // 8, 2, 2, 2))           # (w, b2, b1, b0): code 8w + 4 b2 + 2 b1 + b0
    pw = pw.to(tl.uint32, bitcast=True)                          # logical shifts: no sign extension
    a0, a1 = tl.split(a8)
    for b0 in tl.static_range(2):
        a00, a01 = tl.split(a0 if b0 == 0 else a1)
        for b1 in tl.static_range(2):
            p0, p1 = tl.split(a00 if b1 == 0 else a01)
            for b2 in tl.static_range(2):
                w = _nibble_value((pw >> (16 * b2 + 8 * b1 + 4 * b0)) & 15, off[None, :])   # code 4 b2 + 2 b1 + b0
                #                                                                               minus the zero point
                d = _product1(p0 if b2 == 0 else p1, w, d, True, INTERP)
    return d


@triton.jit
def _grouped_w4_kernel(a_ptr, b_ptr, c_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, off_ptr, tok_ptr,
                       E, N, K, K_SPLIT, stride_a, stride_be, stride_bn, stride_se, stride_sn, stride_c, stride_p,
                       num_n, WFMT: tl.constexpr, HAS_Z: tl.constexpr, HAS_G: tl.constexpr, HAS_BIAS: tl.constexpr,
                       IDENTITY: tl.constexpr, PARTIAL: tl.constexpr, INTERP: tl.constexpr, GROUP: tl.constexpr,
                       S: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (tiles * num_n, split_k). S codes per dot pair (int4: min(BLOCK_K, GROUP); fp4:
    BLOCK_K); K_SPLIT a multiple of BLOCK_K and GROUP. PREFETCH (small BLOCK_M: decode): the
    next S codes' operands are loaded into registers before the current ones are multiplied (in
    flight during the dots; Triton's num_stages pipelining does not take loads that are decoded
    before the dot); at large BLOCK_M those registers would spill."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, E_PAD, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_end, k_lo + K_SPLIT)
    a_base = a_ptr + tok[:, None] * stride_a
    w_base = b_ptr + e * stride_be + n64[None, :] * stride_bn
    s_row = e * stride_se + n64 * stride_sn                      # [BN] offsets of the columns' scale rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)        # int4 with S < GROUP: the group's running sum
    NG: tl.constexpr = S // GROUP if S >= GROUP else 1          # fp4: scale groups per dot pair
    WORDS: tl.constexpr = WFMT == 0 and S >= 128               # int4 read as 8-code words: 8 dots of S / 8
    L: tl.constexpr = GROUP // 2 if S >= GROUP else S // 2      # fp4: bytes of a half sharing one scale
    if PREFETCH:
        a_even, a_odd, p, sv, zv = _w4_step(a_base, w_base, s_ptr, z_ptr, s_row, valid, n_ok, k_lo, k_hi, K, WFMT,
                                            HAS_Z, GROUP, S, NG, WORDS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        for i in tl.static_range(BLOCK_K // S):
            ks = k0 + i * S
            if PREFETCH:
                ae_n, ao_n, p_n, sv_n, zv_n = _w4_step(a_base, w_base, s_ptr, z_ptr, s_row, valid, n_ok, ks + S,
                                                       k_hi, K, WFMT, HAS_Z, GROUP, S, NG, WORDS)
            else:
                a_even, a_odd, p, sv, zv = _w4_step(a_base, w_base, s_ptr, z_ptr, s_row, valid, n_ok, ks, k_hi, K,
                                                    WFMT, HAS_Z, GROUP, S, NG, WORDS)
            if WFMT == 0:
                off = 8388616.0 + zv.to(tl.float32)              # 2^23 + 8 + z (w4a16.codes._int4_offset)
                # the dots add into a fresh sum (one group per step) or the group's running one
                d = tl.zeros((BLOCK_M, BLOCK_N), tl.float32) if S == GROUP else part
                if WORDS:   # two's complement nibbles -> code + 8 (xor with 0x88888888 as an int32)
                    d = _word_dots(a_even, p ^ -2004318072, off, d, S, INTERP)
                else:
                    p = p ^ 0x88                                 # two's complement nibbles -> code + 8
                    w_lo = _nibble_value(p & 15, off[None, :])   # code - zero point, exact
                    w_hi = _nibble_value(p >> 4, off[None, :])
                    d = _product1(a_odd, w_hi, _product1(a_even, w_lo, d, True, INTERP), True, INTERP)
                if S == GROUP:
                    acc += d * sv[None, :]
                else:
                    part = d
                    done = (ks + S) % GROUP == 0                 # the group's last step: scale it once
                    acc = tl.where(done, acc + part * sv[None, :], acc)
                    part = tl.where(done, 0.0, part)
            else:
                bs = block_scale(sv, WFMT)                       # [NG, BN]
                w_lo = _fp4_weights(p & 15, bs, NG, L, BLOCK_N)
                w_hi = _fp4_weights(p >> 4, bs, NG, L, BLOCK_N)
                acc = _product1(a_odd, w_hi, _product1(a_even, w_lo, acc, True, INTERP), True, INTERP)
            if PREFETCH:
                a_even, a_odd, p, sv, zv = ae_n, ao_n, p_n, sv_n, zv_n
    if HAS_G:
        acc = acc * tl.load(g_ptr + e)
    _finish(c_ptr, acc, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, pid_k, stride_p, HAS_BIAS, PARTIAL)


@triton.jit
def _w8_step(a_base, b_base, valid, n_ok, k0, k_hi, BLOCK_K: tl.constexpr):
    """A [BM, BLOCK_K] and the int8 codes [BLOCK_K, BN] at k0 (nothing read at or past k_hi <= K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < k_hi
    a = tl.load(a_base + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(b_base + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0, eviction_policy="evict_first")
    return a, b


@triton.jit
def _grouped_w8a16_kernel(a_ptr, b_ptr, c_ptr, s_ptr, bias_ptr, off_ptr, tok_ptr,
                          E, N, K, K_SPLIT, stride_a, stride_be, stride_bn, stride_c, stride_p, num_n,
                          HAS_BIAS: tl.constexpr, IDENTITY: tl.constexpr, PARTIAL: tl.constexpr, INTERP: tl.constexpr,
                          BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = pid // num_n, pid % num_n
    e, rows, valid, tok, k_end = tile_rows(off_ptr, tok_ptr, pid_m, E, K, BLOCK_M, E_PAD, IDENTITY)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_end, k_lo + K_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_base = a_ptr + tok[:, None] * stride_a
    b_base = b_ptr + e * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # loads that feed the dot through a conversion only: Triton's num_stages pipeline takes them
        a, b = _w8_step(a_base, b_base, valid, n_ok, k0, k_hi, BLOCK_K)
        if INTERP or a.dtype == tl.float32:
            bw = b.to(tl.float32)
        else:
            bw = b.to(a.dtype)                                   # int8 -> bf16 / fp16 directly (exact)
        acc = _product1(a, bw, acc, True, INTERP)
    y = acc * tl.load(s_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
    _finish(c_ptr, y, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, pid_k, stride_p, HAS_BIAS, PARTIAL)


def _check_x(x: torch.Tensor) -> None:
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float [T, K] (float32 / bfloat16 / float16), got {x.dtype} {tuple(x.shape)}")


def _output(routing: Routing, N: int, out_dtype, split: int, device) -> torch.Tensor:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}; choose one of {OUT_DTYPES}")
    # zero-filled: rows no expert owns (dropped slots) read as zeros; split-K: one fp32 partial per split
    if split > 1:
        return torch.zeros(split, routing.rows, N, dtype=torch.float32, device=device)
    return torch.zeros(routing.rows, N, dtype=out_dtype, device=device)


def _result(out: torch.Tensor, out_dtype) -> torch.Tensor:
    """The output of a launch: split-K's partials summed over the split axis (fixed order), one rounding."""
    return out.sum(0).to(out_dtype) if out.ndim == 3 else out


def _k_split(K: int, c: GroupedConfig, group: int) -> int:
    """K per split: whole steps and whole groups."""
    unit = max(c.block_k, group)
    return -(-K // (c.split_k * unit)) * unit


def grouped_w4a16(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *,
                  group_size: int | None = None, kind: str = "int4", w_zero: torch.Tensor | None = None,
                  w_global: torch.Tensor | None = None, bias=None, identity: bool = False,
                  config: GroupedConfig | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight-only 4-bit grouped GEMM: out [R, N] (out_dtype) of sorted row r = x[token[r]] . dequant(w[e]).

    x [T, K] fp32 / bf16 / fp16 (the sorted buffer itself with identity=True);
    w_packed uint8 [E, N, K / 2] (pack_int4 of signed int4 codes, or pack_fp4 of e2m1 codes);
    kind "int4": w_scale fp32 [E, N, K / group_size], w_zero int [E, N, K / group_size] or None;
    kind "mxfp4" / "nvfp4": w_scale = the uint8 scale codes [E, N, K / 32] (e8m0) / [E, N, K / 16]
    (e4m3); w_global fp32 [E] (NVFP4's per-expert tensor scale, or any per-expert factor that
    multiplies the accumulator), else None.
    config: tiles / warps / stages / split-K (None: lowbit.ops.grouped_configs.grouped_config)."""
    if kind not in GROUPED_W4:
        raise ValueError(f"kind={kind!r}; choose one of {GROUPED_W4}")
    if w_packed.dtype != torch.uint8 or w_packed.ndim != 3:
        raise TypeError(f"w_packed must be uint8 [E, N, K / 2] (pack_int4 / pack_fp4), got {w_packed.dtype} "
                        f"{tuple(w_packed.shape)}")
    _check_x(x)
    T, K = x.shape
    E, N, Kh = w_packed.shape
    if Kh * 2 != K:
        raise ValueError(f"w_packed holds K = {2 * Kh} codes per row, x has K = {K}")
    group = FP4_GROUPS.get(kind, group_size)
    if group is None or (group_size is not None and group_size != group):
        raise ValueError(f"group_size={group_size} for kind {kind!r}: int4 needs its group size, "
                         f"MXFP4 / NVFP4 use {FP4_GROUPS}")
    if K % group or group % 2:
        raise ValueError(f"K = {K} must be a multiple of group_size = {group} (even)")
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
    c = config or grouped_config("w4a16", E, N, K, routing.rows, W4Format(kind, group, w_zero is not None))
    check_config("w4a16", c, K, group)
    if kind == "mxfp4" and x.dtype == torch.float16:
        x = x.float()              # fp16 cannot hold every e2m1 * 2^e weight: the fp32 dot (exact)
    s = s.contiguous()
    z = None if w_zero is None else w_zero.to(torch.int32).contiguous()
    g = None if w_global is None else w_global.reshape(E).to(torch.float32).contiguous()
    b = check_bias(bias, E, N, x.device)
    xc, w = x.contiguous(), w_packed.contiguous()
    off, tok, tiles, e_pad = schedule_args(routing, c.block_m, identity)
    out = _output(routing, N, out_dtype, c.split_k, x.device)
    num_n = triton.cdiv(N, c.block_n)
    S = min(c.block_k, group) if kind == "int4" else c.block_k
    dummy = out
    launch(_grouped_w4_kernel, (tiles * num_n, c.split_k),
        xc, w, out, s, dummy if z is None else z, dummy if g is None else g, dummy if b is None else b,
        off, tok, E, N, K, _k_split(K, c, group), xc.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), out.stride(-2), out.stride(0), num_n, WFMT=WFMT_CODE[kind], HAS_Z=z is not None,
        HAS_G=g is not None, HAS_BIAS=b is not None, IDENTITY=identity, PARTIAL=c.split_k > 1, INTERP=interpreting(),
        GROUP=group, S=S, PREFETCH=c.uses_prefetch(), BLOCK_M=c.block_m, E_PAD=e_pad, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return _result(out, out_dtype)


def grouped_w8a16(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, routing: Routing, *, bias=None,
                  identity: bool = False, config: GroupedConfig | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight-only int8 grouped GEMM: out [R, N] (out_dtype) of sorted row r = (x[token[r]] . w_codes[e])
    * w_scale[e, n] (+ bias[e, n]). x [T, K] float; w_codes int8 [E, N, K]; w_scale fp32 [E, N].
    config: as grouped_w4a16."""
    if w_codes.dtype != torch.int8 or w_codes.ndim != 3:
        raise TypeError(f"w_codes must be int8 [E, N, K], got {w_codes.dtype} {tuple(w_codes.shape)}")
    _check_x(x)
    T, K = x.shape
    E, N, Kw = w_codes.shape
    if Kw != K:
        raise ValueError(f"w_codes has K = {Kw}, x has K = {K}")
    check_routing(routing, T, E, identity)
    c = config or grouped_config("w8a16", E, N, K, routing.rows)
    check_config("w8a16", c, K)
    s = w_scale.reshape(E, N).to(torch.float32).contiguous()
    b = check_bias(bias, E, N, x.device)
    xc, w = x.contiguous(), w_codes.contiguous()
    off, tok, tiles, e_pad = schedule_args(routing, c.block_m, identity)
    out = _output(routing, N, out_dtype, c.split_k, x.device)
    num_n = triton.cdiv(N, c.block_n)
    launch(_grouped_w8a16_kernel, (tiles * num_n, c.split_k),
        xc, w, out, s, out if b is None else b, off, tok, E, N, K, _k_split(K, c, 1), xc.stride(0),
        w.stride(0), w.stride(1), out.stride(-2), out.stride(0), num_n, HAS_BIAS=b is not None, IDENTITY=identity,
        PARTIAL=c.split_k > 1, INTERP=interpreting(), BLOCK_M=c.block_m, E_PAD=e_pad, BLOCK_N=c.block_n,
        BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
    return _result(out, out_dtype)
