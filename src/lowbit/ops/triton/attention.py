"""Flash attention over a quantized KV cache (prefill and decode), Triton.

One program per (block of BLOCK_M query rows, batch x KV head); the rows are the GQA group's
query heads packed with their tokens, so each K / V tile is loaded once per group. It reads the cache's codes and
scales directly (fp8 e4m3 bit patterns or int8 / int4 values, one scale per tensor, head, token
or head-dim group, broadcast through zero strides) and dequantizes each tile in registers: no
dequantized copy of the cache exists. GQA: query head h reads KV head h // (Hq // Hkv). Causal
masks are bottom-right aligned (key j seen by query i when j <= i + Tk - Tq); the key loop stops
at the tile's last visible key. Head dims and lengths need not be tile multiples (masked loads).

Arithmetic, in this order (lowbit.ops.attention_reference derives the gate from it):
  k = decode(code) * scale (fp32, one rounding; likewise v and q)
  t = (q . k) * c, c = fp32(sm_scale * log2 e), fp32 dot (input_precision="ieee": no tf32)
  or, in the tensor-core mode (MMA), t = (qcodes . kcodes) * q_scale * k_scale * c: the codes are
  exact in bf16, so the bf16 dot's products are exact and its sums fp32; likewise
  p @ v = (Pcodes @ vcodes) * (block factor * v_scale). Same rounding count, so the same gate.
  masked t = -inf; mb = row max of the block; m_new = max(m, mb)
  P codes = grid(fmt_max * exp2(t - mb)) -- per (row, key block) scale, RNE (fp8 by the exact
            encode_e4m3fn, int8 by rint and clamp [0, 127]); p = codes * (exp2(mb - m_new) / fmt_max)
  alpha = exp2(m - m_new); acc = acc * alpha + p @ v (fp32); l = l * alpha + sum(p) (fp32)
  out = acc / l, rounded once to the output dtype (RNE).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import KVQuant

from .common import cast_out, check_device, decode_e4m3fn, encode_e4m3fn, interpreting, launch, rint

_KIND = {"fp8_e4m3fn": 0, "int8": 1, "int4": 1}      # code kinds the kernel decodes; 2 = a float cache
_P_MODE = {"fp8_e4m3fn": 0, "int8": 1, None: 2}
_OUT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_HEAD_DIM = 256
SM90_SHARED = 232448            # bytes one sm_90 block may opt into (227 KiB): the H100 / H200 limit
MAX_STAGES = 3                  # Triton's default software-pipelining depth on sm_90


def smem_bytes(bm: int, bn: int, bd: int, mma: bool, k_bytes: int, v_bytes: int, k_grouped: bool, v_grouped: bool,
               stages: int) -> int:
    """Shared memory the compiled kernel needs, an upper estimate (tests/ops/test_attention_sm90.py
    checks it against Triton's own figure for sm_90): the dot operands staged once (Q [bm, bd],
    K^T and V [bd, bn], P [bm, bn], 4 bytes each in the fp32-dot mode, 2 in the bf16 MMA mode), plus
    for each of the stages - 1 key blocks the pipeliner loads ahead: the K and V code tiles, their
    per-token scale vectors, and in the fp32-dot mode a 4-byte scale per element where the scale
    varies along the head dim (per-group). 1 KiB covers the reductions' scratch."""
    dot = 2 if mma else 4
    base = dot * (bm * bd + 2 * bn * bd + bm * bn) + 1024
    ahead = bn * bd * (k_bytes + v_bytes) + 8 * bn
    ahead += sum(4 * bn * bd for g in (k_grouped, v_grouped) if g and not mma)
    return base + (stages - 1) * ahead


@functools.lru_cache(maxsize=None)
def _shared_limit(device_index: int) -> int:
    """Shared memory one block of this GPU may opt into (sm_90's where torch does not report it)."""
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", SM90_SHARED))


def pick_tiles(rows: int, mma: bool, block_m: int | None = None) -> tuple[int, int]:
    """(BLOCK_M, num_warps). From the sm_90 SASS (tests/ops/test_attention_sm90.py): the fp32-dot
    mode's FMA dot keeps each thread's operand rows across the whole head dim in registers, so it
    takes 16-row tiles over 8 warps (at head_dim 128: ~140 local loads / stores against thousands
    with 64 rows over 4 warps); the tensor-core mode spills nothing with 16 rows over 4 warps or 64
    rows over 8."""
    if mma:
        bm = block_m or (16 if rows <= 16 else 64)
        return bm, 4 if bm <= 16 else 8
    return block_m or 16, 8


def pick_stages(limit: int = SM90_SHARED, **tile) -> int:
    """The deepest pipelining (MAX_STAGES down to 1) whose smem_bytes(**tile) fits `limit`."""
    for stages in range(MAX_STAGES, 0, -1):
        if smem_bytes(stages=stages, **tile) <= limit:
            return stages
    raise ValueError(f"attention tiles {tile} need {smem_bytes(stages=1, **tile)} bytes of shared memory even "
                     f"unpipelined (limit {limit}): use a smaller head_dim or backend='torch'")


@triton.jit
def _load_tile(ptr, s_ptr, b, h, offs_t, offs_d, T, D, st_b, st_h, st_t, st_d, ss_b, ss_h, ss_t, ss_g, GS,
               KIND: tl.constexpr, SCALED: tl.constexpr, GROUPED: tl.constexpr):
    """[BLOCK_N, BLOCK_D] fp32 tile of one KV head (zeros outside T x D): the code values, times
    their scale when SCALED. One scale per token row unless GROUPED (per head-dim group): a
    [BLOCK_N] vector then, not a 4-byte scale per element loaded and staged in shared memory."""
    ok = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    raw = tl.load(ptr + b * st_b + h * st_h + offs_t[:, None] * st_t + offs_d[None, :] * st_d, mask=ok, other=0)
    if KIND == 2:
        return raw.to(tl.float32)
    if KIND == 0:
        val = decode_e4m3fn(raw.to(tl.int32))
    else:
        val = raw.to(tl.float32)
    if SCALED:
        if GROUPED:
            s = tl.load(s_ptr + b * ss_b + h * ss_h + offs_t[:, None] * ss_t + (offs_d // GS)[None, :] * ss_g,
                        mask=ok, other=0.0)
            val = val * s
        else:
            s = tl.load(s_ptr + b * ss_b + h * ss_h + offs_t * ss_t, mask=offs_t < T, other=0.0)
            val = val * s[:, None]
    return val


@triton.jit
def code_tile(ptr, b, h, offs_t, offs_d, T, D, st_b, st_h, st_t, st_d, KIND: tl.constexpr, FAST_FP8: tl.constexpr,
              EVEN_D: tl.constexpr, DOT_TY: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile of one KV head's codes (or bf16 values, KIND 2) in DOT_TY, exact,
    zeros outside T x D; the scales are applied after the dots. FAST_FP8 (the GPU): e4m3 -> f16 by
    the hardware's conversion, two per instruction; the interpreter decodes the bits (decode_e4m3fn)."""
    if EVEN_D:
        ok = (offs_t < T)[:, None]
    else:
        ok = (offs_t < T)[:, None] & (offs_d < D)[None, :]
    raw = tl.load(ptr + b * st_b + h * st_h + offs_t[:, None] * st_t + offs_d[None, :] * st_d, mask=ok, other=0)
    return codes_as(raw, KIND, FAST_FP8, DOT_TY)


@triton.jit
def codes_as(raw, KIND: tl.constexpr, FAST_FP8: tl.constexpr, DOT_TY: tl.constexpr):
    """Loaded cache codes (fp8 e4m3 bit patterns, KIND 0; int8 or bf16 values otherwise) as DOT_TY
    values, exact."""
    if KIND == 0:
        if FAST_FP8:
            return raw.to(tl.float8e4nv, bitcast=True).to(DOT_TY)
        return decode_e4m3fn(raw.to(tl.int32)).to(DOT_TY)
    return raw.to(DOT_TY)


@triton.jit
def p_codes(v, P_MODE: tl.constexpr, FAST_FP8: tl.constexpr):
    """P's code values (fp32) of v = fmt_max * exp2(t - mb) in [0, fmt_max]: fp8 e4m3 RNE (on the
    GPU its cvt.rn.satfinite, two per instruction; in the interpreter the exact bit encoder), int8
    by rint and clamp to [0, 127], or v itself (P kept in fp32)."""
    if P_MODE == 0:
        if FAST_FP8:
            return v.to(tl.float8e4nv).to(tl.float32)
        return decode_e4m3fn(encode_e4m3fn(v).to(tl.int32))
    elif P_MODE == 1:
        return tl.minimum(tl.maximum(rint(v), 0.0), 127.0)
    return v

@triton.jit
def softmax_block(t, seen, m_i, FMAX: tl.constexpr, P_MODE: tl.constexpr, FAST_FP8: tl.constexpr):
    """One key block of the online softmax with P quantized per block, shared by the prefill and
    split-KV kernels: t the scores (log2 units) [rows, keys], seen the mask, m_i the running row
    maxima. P's codes are of fmt_max * exp2(t - mb) with the block's own maximum mb (so the block's
    largest P is fmt_max exactly); f = exp2(mb - m_new) / fmt_max turns codes into probabilities on
    the running maximum m_new, alpha = exp2(m_i - m_new) rescales what was accumulated before.
    Fully masked rows give codes 0, f 0 and keep their maximum. Returns (next m_i, codes, f, alpha)."""
    t = tl.where(seen, t, float("-inf"))
    mb = tl.max(t, axis=1)
    ok = mb > float("-inf")
    mb0 = tl.where(ok, mb, 0.0)
    m_new = tl.maximum(m_i, mb)
    m_new0 = tl.where(m_new > float("-inf"), m_new, mb0)
    x = tl.where(seen, tl.exp2(t - mb0[:, None]), 0.0)
    codes = p_codes(x * FMAX, P_MODE, FAST_FP8)
    f = tl.where(ok, tl.math.div_rn(tl.exp2(mb0 - m_new0), FMAX), 0.0)
    alpha = tl.where(m_i > float("-inf"), tl.exp2(m_i - m_new0), 0.0)
    return tl.where(m_new > float("-inf"), m_new, m_i), codes, f, alpha



@triton.jit
def _flash_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, Tq, Tk, D, G, c,
                  sq_b, sq_h, sq_t, sq_d, sqs_b, sqs_h, sqs_t,
                  sk_b, sk_h, sk_t, sk_d, sks_b, sks_h, sks_t, sks_g, K_GS,
                  sv_b, sv_h, sv_t, sv_d, svs_b, svs_h, svs_t, svs_g, V_GS, so_b, so_h, so_t, so_d, Hkv,
                  K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_GROUPED: tl.constexpr, V_GROUPED: tl.constexpr,
                  P_MODE: tl.constexpr, FMAX: tl.constexpr,
                  CAUSAL: tl.constexpr, MMA: tl.constexpr, DOT_TY: tl.constexpr, DOT_PREC: tl.constexpr,
                  FAST_FP8: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, OUT_TY: tl.constexpr):
    # rows are the G query heads of one KV head packed with their tokens (row = g * Tq + i), so each
    # K / V tile is read once for the whole group
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)        # batch offsets in 64 bits: a cache past 2^31 bytes per layer
    hk = pid_bh % Hkv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    h = hk * G + rows // Tq
    offs_m = rows % Tq
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = rows < G * Tq
    q_ok = row_ok[:, None] & (offs_d < D)[None, :]
    q_off = b * sq_b + h[:, None] * sq_h + offs_m[:, None] * sq_t + offs_d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=q_ok, other=0.0)
    qs = tl.load(qs_ptr + b * sqs_b + h * sqs_h + offs_m * sqs_t, mask=row_ok, other=1.0)
    # Triton 3.6's interpreter multiplies bf16 dot operands wrongly: there DOT_TY is fp32, holding
    # the same exact values (and "ieee": no tf32); on the GPU bf16 ("tf32" is ignored for bf16)
    if MMA:
        q_in = q.to(DOT_TY)                 # code values: exact in bf16; the scale comes after the dot
        v_head_scale = tl.load(vs_ptr + b * svs_b + hk * svs_h)
    else:
        q_in = q * qs[:, None]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.zeros([], tl.int32) + Tk        # a tensor even when Triton specializes Tk == 1 to a constant
    if CAUSAL:
        first = (pid_m * BLOCK_M) % Tq
        if first + BLOCK_M <= Tq:               # the tile holds one head's queries first .. first + BLOCK_M - 1
            hi = tl.minimum(Tk, first + BLOCK_M + Tk - Tq)
    for start in range(0, hi, BLOCK_N):
        offs_k = start + offs_n
        if MMA:
            kt = code_tile(k_ptr, b, hk, offs_k, offs_d, Tk, D, sk_b, sk_h, sk_t, sk_d, K_KIND, FAST_FP8, False, DOT_TY)
            ks = tl.load(ks_ptr + b * sks_b + hk * sks_h + offs_k * sks_t, mask=offs_k < Tk, other=0.0)
            t = tl.dot(q_in, tl.trans(kt), input_precision=DOT_PREC) * qs[:, None] * ks[None, :] * c
        else:
            kt = _load_tile(k_ptr, ks_ptr, b, hk, offs_k, offs_d, Tk, D, sk_b, sk_h, sk_t, sk_d,
                            sks_b, sks_h, sks_t, sks_g, K_GS, K_KIND, True, K_GROUPED)
            t = tl.dot(q_in, tl.trans(kt), input_precision="ieee") * c
        seen = (offs_k < Tk)[None, :] & (offs_m >= 0)[:, None]
        if CAUSAL:
            seen = seen & (offs_k[None, :] <= offs_m[:, None] + (Tk - Tq))
        m_next, codes, f, alpha = softmax_block(t, seen, m_i, FMAX, P_MODE, FAST_FP8)
        if MMA:
            vt = code_tile(v_ptr, b, hk, offs_k, offs_d, Tk, D, sv_b, sv_h, sv_t, sv_d, V_KIND, FAST_FP8, False, DOT_TY)
            # P codes and V codes are exact in DOT_TY: tensor-core products, fp32 sums; scales after
            pv = tl.dot(codes.to(DOT_TY), vt, input_precision=DOT_PREC) * (f * v_head_scale)[:, None]
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(codes, axis=1) * f
        else:
            vt = _load_tile(v_ptr, vs_ptr, b, hk, offs_k, offs_d, Tk, D, sv_b, sv_h, sv_t, sv_d,
                            svs_b, svs_h, svs_t, svs_g, V_GS, V_KIND, True, V_GROUPED)
            p = codes * f[:, None]
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_next
    out = tl.math.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None])
    tl.store(o_ptr + b * so_b + h[:, None] * so_h + offs_m[:, None] * so_t + offs_d[None, :] * so_d,
             cast_out(out, OUT_TY), mask=q_ok)


def _operand(t, name: str, B: int, H: int, T: int, D: int):
    """(codes / values tensor, scale tensor [B,H,T,G] with zero strides, group size, kind); the
    group size is D unless the scale varies along the head dim."""
    if isinstance(t, KVQuant):
        t = t.unpacked()            # the tile loader reads one int4 code per byte (int4 is stored packed)
        kind = _KIND.get(t.scheme.format)
        if kind is None:
            raise ValueError(f"{name}: no kernel decoder for {t.scheme.format}")
        s = t.scale_bhtg()
        if s.dtype != torch.float32:
            raise ValueError(f"{name}.scale must be float32 (what the cache writes), got {s.dtype}")
        check_device(f"{name}.codes", t.codes)
        return t.codes, s, D // s.shape[-1], kind
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: an unquantized cache must be float32 / bfloat16 / float16, got {t.dtype}")
    check_device(name, t)
    dummy = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=t.device).expand(B, H, T, 1)
    return t, dummy, D, 2


def _mma_ok(q_vals: torch.Tensor, q_exact: bool, k, v, spec: ar.AttnSpec) -> bool:
    """The tensor-core mode needs every dot operand exact in bf16 and the scales outside the dots:
    Q, K, V and P as codes (or bf16 values), K scaled per token / head / tensor (not per head-dim
    group), V scaled per head / tensor (constant along the keys the P.V dot sums over)."""
    if not q_exact or spec.p_format is None:
        return False
    for t, static_only in ((k, False), (v, True)):
        if isinstance(t, KVQuant):
            if t.scheme.granularity == "group" or (static_only and t.scheme.dynamic):
                return False
        elif t.dtype != torch.bfloat16:
            return False
    return True


def check_call(q_vals: torch.Tensor, k, v, spec: ar.AttnSpec, q_scale: torch.Tensor | None,
               out_dtype: torch.dtype) -> tuple[int, torch.Tensor, bool]:
    """The argument checks every tile kernel's launcher makes (this module's and the prefill kernel's):
    device, shapes (GQA group G), head_dim, output dtype, a causal mask with fewer keys than queries.
    Returns (G, q_scale as fp32 [B, Hq, Tq, 1] -- ones where Q is given as values --, q_exact: Q is
    codes or bf16, so its products are exact on the tensor cores)."""
    check_device("q", q_vals)
    G = ar.check_shapes(tuple(q_vals.shape), tuple(k.shape), tuple(v.shape))
    B, Hq, Tq, D = q_vals.shape
    Tk = k.shape[2]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}: the kernel keeps a query tile of the whole head in "
                         "registers; use backend='torch'")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be one of {list(_OUT)}, got {out_dtype}")
    if spec.causal and Tk < Tq:
        ar.allowed_mask(Tq, Tk, True)                          # raises the reference's error
    q_exact = q_scale is not None or q_vals.dtype == torch.bfloat16
    if q_scale is None:
        q_scale = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=q_vals.device).expand(B, Hq, Tq, 1)
    elif q_scale.shape != (B, Hq, Tq, 1) or q_scale.dtype != torch.float32:
        raise ValueError(f"q_scale must be float32 [B, Hq, Tq, 1] = {(B, Hq, Tq, 1)}, got {q_scale.dtype} "
                         f"{tuple(q_scale.shape)}")
    return G, q_scale, q_exact


def flash_attention(q_vals: torch.Tensor, k, v, spec: ar.AttnSpec, *, q_scale: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32, block_m: int | None = None, mma: bool | None = None
                    ) -> torch.Tensor:
    """q_vals: fp32 [B, Hq, Tq, D], Q's code values (lowbit.ops.attention.quantize_q's parts) with
    q_scale [B, Hq, Tq, 1] fp32, or Q itself with q_scale None; k, v: KVQuant or float
    [B, Hkv, Tk, D]. mma: the bf16 tensor-core mode (module docstring); None = wherever it is exact
    (Q as codes, or Q given in bf16). Returns [B, Hq, Tq, D] in out_dtype."""
    G, q_scale, q_exact = check_call(q_vals, k, v, spec, q_scale, out_dtype)
    B, Hq, Tq, D = q_vals.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    use_mma = _mma_ok(q_vals, q_exact, k, v, spec) if mma is None else mma
    if use_mma and not _mma_ok(q_vals, q_exact, k, v, spec):
        raise ValueError("mma=True needs Q as codes (q_scale) or bf16, P quantized, K not per head-dim group and "
                         "V scaled per head or tensor; pass mma=None to choose automatically")
    q32 = q_vals.to(torch.float32)
    kc, ks, kgs, kk = _operand(k, "k", B, Hkv, Tk, D)
    vc, vs, vgs, vk = _operand(v, "v", B, Hkv, Tk, D)
    out = torch.empty(B, Hq, Tq, D, dtype=out_dtype, device=q_vals.device)
    rows = G * Tq
    bm, warps = pick_tiles(rows, bool(use_mma), block_m)
    bd = max(16, triton.next_power_of_2(D))
    limit = SM90_SHARED if interpreting() else _shared_limit(q_vals.device.index or 0)
    stages = pick_stages(limit, bm=bm, bn=spec.p_block, bd=bd, mma=bool(use_mma), k_bytes=kc.element_size(),
                         v_bytes=vc.element_size(), k_grouped=kgs < D, v_grouped=vgs < D)
    c = float(torch.tensor(spec.scale_for(D) * ar.LOG2E, dtype=torch.float32))
    # the dots' operand type: fp16 holds every code exactly (and e4m3 converts to it in one instruction
    # per pair); bf16 where Q or the cache is bf16 data; Triton 3.6's interpreter multiplies 16-bit dot
    # operands wrongly, so there fp32 holds the same exact values
    codes_only = q_vals.dtype != torch.bfloat16 and kk != 2 and vk != 2
    dot_ty = tl.float32 if interpreting() else tl.float16 if codes_only else tl.bfloat16
    grid = (triton.cdiv(rows, bm), B * Hkv)
    launch(_flash_kernel, grid, q32, q_scale, kc, ks, vc, vs, out, Tq, Tk, D, G, c,
           *q32.stride(), *q_scale.stride()[:3], *kc.stride(), *ks.stride(), kgs, *vc.stride(), *vs.stride(), vgs,
           *out.stride(), Hkv,
           K_KIND=kk, V_KIND=vk, K_GROUPED=kgs < D, V_GROUPED=vgs < D, P_MODE=_P_MODE[spec.p_format],
           FMAX=float(spec.p_max), CAUSAL=spec.causal, MMA=bool(use_mma),
           DOT_TY=dot_ty, DOT_PREC="ieee" if interpreting() else "tf32", FAST_FP8=not interpreting(),
           BLOCK_M=bm, BLOCK_N=spec.p_block, BLOCK_D=bd, OUT_TY=_OUT[out_dtype], num_warps=warps,
           num_stages=stages)
    return out


def cache_bytes(k, v) -> int:
    """Bytes the kernel reads from the cache (codes + scales as stored, not broadcast)."""
    return sum(t.nbytes() if isinstance(t, KVQuant) else t.numel() * t.element_size() for t in (k, v))


