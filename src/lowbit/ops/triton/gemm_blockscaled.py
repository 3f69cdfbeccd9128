"""Block-scaled FP8 GEMMs on GPUs without a block-scaled MMA (Hopper): the K axis is cut into
groups of G values that share a scale, each group's fp8 x fp8 product is taken on the tensor
cores into a fresh fp32 partial, and the partial is rescaled in fp32 before it joins the
accumulator:

    out[m, n] = sum_g  dot(a[m, g*G:(g+1)*G], b[n, g*G:(g+1)*G]) * (sa[m, g] * sb[n // R, g])
    (on the GPU each step acc + part * (sa * sb) is one FMA -- Triton contracts it --, in the
    interpreter two roundings; tests/ops/test_epilogue_order.py pins both)

Two layouts use it:
- DeepSeek-V3 style: activations with 1x128 blocks (sa: fp32 [M, K/128]) and weights with
  128x128 blocks (sb: fp32 [ceil(N/128), K/128]); G = 128, R = 128.
- per-32 groups with fp32 scales (G = 32, R = 1) take the same kernel.
MXFP8 with e8m0 codes (mxfp8_gemm) uses a second kernel: Hopper has no MX datapath, and
rescaling a partial product every 32 values serialises the tensor cores (measured: 26-118
TFLOP/s at 8192^3), so each fp8 tile is multiplied by its power-of-two scales and fed to the
bf16 tensor cores instead -- exact, see mxfp8_gemm (what `lowbit doctor` reports as "emulated").
The rescaling also bounds the fp8 MMA's reduced-precision accumulation to one group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (bias_store_tile, check_bias, check_operands, check_out_dtype, decode_e8m0, interpreting,
                     kmajor_ptrs, pick_config, prepare_launch, swizzled_tile, tile_offsets)
from lowbit.ops.float_gemm import bf16_gemm

from .dequant import dequantize_groups
from .gemm_fp8 import as_fp8


@triton.jit
def _load_scale(ptr, E8M0: tl.constexpr, mask):
    if E8M0:
        s = decode_e8m0(tl.load(ptr, mask=mask, other=0))
    else:
        s = tl.load(ptr, mask=mask, other=0.0)
    return s


@triton.jit
def _blockscaled_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
                      M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
                      G: tl.constexpr, R: tl.constexpr, E8M0: tl.constexpr, HAS_BIAS: tl.constexpr,
                      USE_TMA: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    SUB: tl.constexpr = BLOCK_K // G
    # One weight scale for the whole tile when the tile sits inside one R-row scale block.
    SB_UNIFORM: tl.constexpr = (R > 1) and (R % BLOCK_N == 0)
    # Offsets written out, not tile_offsets: that extra inlined call changed the persistent TMA
    # variant's machine code under ptxas -lineinfo (common.bias_store_tile says more).
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, G)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_a = tl.where(m_ok, offs_m, 0)
    rows_b = tl.where(n_ok, offs_n, 0)
    a_ptrs = a_ptr
    b_ptrs = b_ptr
    if not USE_TMA:
        a_ptrs = kmajor_ptrs(a_ptr, rows_a, stride_am, offs_g)
        b_ptrs = kmajor_ptrs(b_ptr, rows_b, stride_bn, offs_g)
    sa_ptrs = sa_ptr + rows_a.to(tl.int64) * stride_sam
    if SB_UNIFORM:
        sb_ptrs = sb_ptr + ((pid_n * BLOCK_N) // R) * stride_sbn
    else:
        sb_ptrs = sb_ptr + (rows_b // R).to(tl.int64) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for s in tl.static_range(SUB):
            kk = k0 + s * G
            ok = kk < K  # K is a multiple of G: a group is wholly inside K or wholly past it
            if USE_TMA:  # past K the copy engine fills zeros
                a = a_ptrs.load([pid_m * BLOCK_M, kk])
                b = b_ptrs.load([pid_n * BLOCK_N, kk])
            else:
                a = tl.load(a_ptrs + kk, mask=ok, other=0.0)
                b = tl.load(b_ptrs + kk, mask=ok, other=0.0)
            part = tl.dot(a, tl.trans(b))
            g = kk // G
            sa = _load_scale(sa_ptrs + g, E8M0, ok)
            sb = _load_scale(sb_ptrs + g, E8M0, ok)
            if SB_UNIFORM:
                acc += part * (sa * sb)[:, None]
            else:
                acc += part * (sa[:, None] * sb[None, :])
    bias_store_tile(acc, offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS)


@triton.jit
def _blockscaled_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
                        M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
                        G: tl.constexpr, R: tl.constexpr, E8M0: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
                        NUM_SMS: tl.constexpr):
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _blockscaled_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
                              M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
                              G, R, E8M0, HAS_BIAS, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _blockscaled_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
                          M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
                          G, R, E8M0, HAS_BIAS, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _scaled_bf16(x, e, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 tile [ROWS, BLOCK_K] times its e8m0 scales [ROWS, BLOCK_K // 32] -> bf16, exactly:
    an e4m3 value (4 significant bits) times a power of two fits bf16's 8 bits unless the
    product leaves the normal range (see mxfp8_gemm)."""
    s = decode_e8m0(e)
    x3 = tl.reshape(x.to(tl.float32), (ROWS, BLOCK_K // 32, 32)) * s[:, :, None]
    return tl.reshape(x3, (ROWS, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _bf16_dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b.T for bf16 tiles. Triton 3.6's interpreter multiplies bf16 tiles as their raw
    uint16 bit patterns, so there the (bf16-exact) values go through an fp32 matmul instead."""
    if INTERP:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _mx_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n,
             M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
             HAS_BIAS: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    NG: tl.constexpr = BLOCK_K // 32
    offs_m, offs_n, m_ok, n_ok = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, NG)
    rows_a = tl.where(m_ok, offs_m, 0)
    rows_b = tl.where(n_ok, offs_n, 0)
    a_ptrs = a_ptr
    b_ptrs = b_ptr
    if not USE_TMA:
        a_ptrs = kmajor_ptrs(a_ptr, rows_a, stride_am, offs_k)
        b_ptrs = kmajor_ptrs(b_ptr, rows_b, stride_bn, offs_k)
    # The e8m0 scale matrices [rows, K/32] are row-major too: the tile's [rows, NG] codes per K step.
    sa_ptrs = kmajor_ptrs(sa_ptr, rows_a, stride_sam, offs_g)
    sb_ptrs = kmajor_ptrs(sb_ptr, rows_b, stride_sbn, offs_g)
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if USE_TMA:
            a = a_ptrs.load([pid_m * BLOCK_M, k0])
            b = b_ptrs.load([pid_n * BLOCK_N, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs + k0)
            b = tl.load(b_ptrs + k0)
        else:
            k_ok = offs_k[None, :] < K - k0
            a = tl.load(a_ptrs + k0, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs + k0, mask=k_ok, other=0.0)
        g_ok = offs_g[None, :] < groups - k0 // 32
        ea = tl.load(sa_ptrs + k0 // 32, mask=g_ok, other=127)
        eb = tl.load(sb_ptrs + k0 // 32, mask=g_ok, other=127)
        acc = _bf16_dot(_scaled_bf16(a, ea, BLOCK_M, BLOCK_K), _scaled_bf16(b, eb, BLOCK_N, BLOCK_K), acc, INTERP)
    bias_store_tile(acc, offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS)


@triton.jit
def _mx_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr,
               M, N, K, stride_am, stride_bn, stride_cm, stride_sam, stride_sbn,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
               NUM_SMS: tl.constexpr, INTERP: tl.constexpr):
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            pid_m, pid_n = swizzled_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _mx_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n, M, N, K, stride_am,
                     stride_bn, stride_cm, stride_sam, stride_sbn, HAS_BIAS, USE_TMA, EVEN_K, INTERP,
                     BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        pid_m, pid_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        _mx_tile(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, pid_m, pid_n, M, N, K, stride_am,
                 stride_bn, stride_cm, stride_sam, stride_sbn, HAS_BIAS, USE_TMA, EVEN_K, INTERP,
                 BLOCK_M, BLOCK_N, BLOCK_K)


def _check_scales(name: str, s: torch.Tensor, rows: int, groups: int, what: str) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor")
    if s.dtype not in (torch.float32, torch.uint8):
        raise TypeError(f"{name} has dtype {s.dtype}; expected float32 scales or uint8 e8m0 codes")
    if tuple(s.shape) != (rows, groups):
        raise ValueError(f"{name} has shape {tuple(s.shape)}; expected ({rows}, {groups}) = {what}")
    return s if s.stride(1) == 1 else s.contiguous()


def _check_grouped(a: torch.Tensor, b: torch.Tensor, group: int, unit: str, out_dtype: torch.dtype):
    """fp8 views of a [M, K], b [N, K] and (M, N, K), with K a positive multiple of `group`
    (`unit` names what the group is, for the error)."""
    a = as_fp8("a", a)
    b = as_fp8("b", b)
    M, N, K = check_operands(a, b)
    if K == 0 or K % group:
        raise ValueError(f"K={K} is not a multiple of {unit} {group}: pad K with zeros to "
                         f"{-(-K // group) * group} (zero codes add nothing) before quantizing")
    check_out_dtype(out_dtype)
    return a, b, M, N, K


def _grouped_config(config: dict | None, M: int, N: int, K: int, group: int, kind: str) -> dict:
    """The launch config (given or picked), whose BLOCK_K must hold whole scale groups."""
    cfg = dict(config) if config else pick_config(M, N, K, block_k_multiple=group, kind=kind)
    if cfg["BLOCK_K"] % group:
        raise ValueError(f"config BLOCK_K={cfg['BLOCK_K']} must be a multiple of group={group}")
    return cfg


def blockscaled_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                     *, group: int, weight_block_rows: int, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """fp8 e4m3fn [M, K] x [N, K] -> [M, N] with scales per `group` K-values.

    a_scale: [M, K/group]; b_scale: [ceil(N/weight_block_rows), K/group]; both fp32, or both
    uint8 e8m0 codes (decoded exactly to 2**(c-127) in the kernel). bias: [N], added in fp32.
    """
    if group not in (32, 64, 128) or weight_block_rows < 1:
        raise ValueError(f"group={group} must be 32, 64 or 128 and weight_block_rows >= 1")
    a, b, M, N, K = _check_grouped(a, b, group, "the scale group size", out_dtype)
    groups = K // group
    sa = _check_scales("a_scale", a_scale, M, groups, f"(M, K/{group})")
    nb = -(-N // weight_block_rows)
    sb = _check_scales("b_scale", b_scale, nb, groups, f"(ceil(N/{weight_block_rows}), K/{group})")
    if sa.dtype != sb.dtype:
        raise TypeError(f"a_scale is {sa.dtype} but b_scale is {sb.dtype}: pass both as fp32 or both "
                        "as e8m0 codes")
    bias = check_bias(bias, N)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    cfg = _grouped_config(config, M, N, K, group, f"block{group}")
    grid, opts, a_arg, b_arg = prepare_launch(cfg, a, b, box_k=group)  # one bulk copy per group-wide K slice
    _blockscaled_kernel[grid](
        a_arg, b_arg, c, sa, sb, bias if bias is not None else c,
        M, N, K, a.stride(0), b.stride(0), c.stride(0), sa.stride(0), sb.stride(0),
        G=group, R=weight_block_rows, E8M0=sa.dtype == torch.uint8, HAS_BIAS=bias is not None, **opts)
    return c


def fp8_block_gemm(a, b, a_scale, b_scale, *, bias=None, out_dtype=torch.bfloat16, config=None):
    """DeepSeek-V3 layout: 1x128 activation blocks, 128x128 weight blocks, fp32 scales."""
    return blockscaled_gemm(a, b, a_scale, b_scale, group=128, weight_block_rows=128, bias=bias,
                            out_dtype=out_dtype, config=config)


# From this many rows on (and without a forced config) mxfp8_gemm dequantizes both operands to
# bf16 and runs one cuBLAS bf16 GEMM instead of the Triton kernel: the kernel's per-tile
# scaling runs on the CUDA cores between the bf16 MMAs (~270-300 TFLOP/s at M >= 2048 on the
# H200, 0.22x of _scaled_mm row-wise), while the dequantization is two memory-bound passes
# (3 bytes per element moved) and the GEMM then runs at bf16 speed. (A quantized layer's choice
# between the two is lowbit.ops.tuning's; this threshold serves direct calls of mxfp8_gemm.)
MX_DEQUANT_MIN_M = 256


def mxfp8_dequant_gemm(a, b, a_scale, b_scale, bias=None, out_dtype=torch.bfloat16, b_out=None):
    """MXFP8 (e8m0 codes) by dequantization: a, b to bf16 (a_scale, b_scale applied; exact in the
    range mxfp8_gemm states: the same operand values as its kernel), then one bf16 GEMM with
    fp32 accumulation: straight to bf16 (one rounding of the fp32 sum) without a bias, else
    float32 out (torch.mm out_dtype on CUDA), the bias added in fp32 and one rounding. Caveat:
    the bf16-output GEMM is cuBLAS's, which PyTorch lets reduce split-K partial sums in bf16
    unless torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False. Operands
    as mxfp8_gemm's, unchecked (mxfp8_gemm and lowbit.ops.prepared check them); b_out: a bf16
    [N, K] buffer to dequantize b into (lowbit.ops.scratch's), or None for a new one."""
    A = dequantize_groups(a.view(torch.uint8), a_scale, 32, "e4m3", "e8m0")
    B = dequantize_groups(b.view(torch.uint8), b_scale, 32, "e4m3", "e8m0", b_out)
    return bf16_gemm(A, B, bias, out_dtype)


def mxfp8_gemm(a, b, a_scale, b_scale, *, bias=None, out_dtype=torch.bfloat16, config=None):
    """MXFP8: fp8 e4m3fn [M, K] x [N, K] with e8m0 scales per 32 values on both operands.

    a_scale: uint8 e8m0 codes [M, K/32]; b_scale: [N, K/32]. Hopper has no MX datapath. The
    kernel multiplies each fp8 tile by its power-of-two scales in fp32 and feeds the products
    as bf16 to the bf16 tensor cores (fp32 accumulation). This is exact while every scaled
    element is zero or a normal bf16 number: codes >= 10 on elements >= 2**-9 (e4m3's smallest
    subnormal) and scaled magnitudes < 2**128, which holds for every code lowbit.quantize makes
    from finite float32 data with group amax >= 2**-108. From MX_DEQUANT_MIN_M rows on (config
    None) the same bf16 operands are made by a dequantization pass and multiplied by cuBLAS
    (mxfp8_dequant_gemm). fp32 scales (any values) go through
    blockscaled_gemm(group=32), which rescales fp8 partial products per 32-wide K step instead.
    """
    if not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.uint8 or \
            not isinstance(b_scale, torch.Tensor) or b_scale.dtype != torch.uint8:
        return blockscaled_gemm(a, b, a_scale, b_scale, group=32, weight_block_rows=1, bias=bias,
                                out_dtype=out_dtype, config=config)
    a, b, M, N, K = _check_grouped(a, b, 32, "the MX block size", out_dtype)
    sa = _check_scales("a_scale", a_scale, M, K // 32, "(M, K/32)")
    sb = _check_scales("b_scale", b_scale, N, K // 32, "(N, K/32)")
    bias = check_bias(bias, N)
    if M and N and config is None and M >= MX_DEQUANT_MIN_M:
        return mxfp8_dequant_gemm(a, b, sa, sb, bias, out_dtype)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    cfg = _grouped_config(config, M, N, K, 32, "mx")
    grid, opts, a_arg, b_arg = prepare_launch(cfg, a, b)
    _mx_kernel[grid](a_arg, b_arg, c, sa, sb, bias if bias is not None else c,
                     M, N, K, a.stride(0), b.stride(0), c.stride(0), sa.stride(0), sb.stride(0),
                     HAS_BIAS=bias is not None, EVEN_K=K % cfg["BLOCK_K"] == 0, INTERP=interpreting(), **opts)
    return c
