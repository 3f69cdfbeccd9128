"""Prefill attention over a quantized KV cache on Hopper-sized tensor-core tiles, Triton.

One program per (batch x query head, block of BLOCK_M query tokens of that head): the layout of
FlashAttention-2 and Triton's fused-attention tutorial, not the GQA row packing of the general
kernel (lowbit.ops.triton.attention), so a tile never straddles two heads and the causal bounds
are per tile; the G query heads of one KV head run as neighbouring programs and share its K / V
tiles through L2. Query blocks are launched last block first (the longest key loops under a
causal mask start in the first wave). The key loop runs in two parts: the blocks every row of the
tile sees entirely (no mask, no bounds check on the loads) and the diagonal / tail blocks (masked,
bottom-right aligned: key j seen by query i when j <= i + Tk - Tq). Fully masked blocks are never
visited. The key block is the P block (BLOCK_N = spec.p_block): P's scale is per (row, p_block).

Operands, as the cache stores them: K codes (fp8 e4m3 bit patterns or int8) scaled per tensor, KV
head or token, or a bf16 K; V codes scaled per tensor or head (static), or a bf16 V; Q as code
values with a per-(token, head) scale, or bf16 Q. Codes are exact in fp16 (e4m3 converts to fp16
in one instruction per pair) and bf16 data exact in bf16, so both dots run on tensor cores with
exact products and fp32 sums, the scales applied to the fp32 results.

Arithmetic, in this order (the same rounding count as the general kernel's tensor-core mode, so
lowbit.ops.attention_reference's gate applies unchanged):
  r = (q_scale * c) [* k_scale per tensor / head], c = fp32(sm_scale * log2 e)   (per row)
  t = dot(q codes, k codes) * r [* k_scale per token]      D exact products, fp32 sums, <= 3 roundings
  masked t = -inf (diagonal / tail blocks only); mb = row max of the block; m_new = max(m, mb)
  P codes = grid(fmt_max * exp2(t - mb)) RNE (fp8: the GPU's cvt.rn.satfinite, in the interpreter
            encode_e4m3fn; int8: rint, clamp [0, 127]); f = exp2(mb - m_new) / fmt_max (IEEE div)
  alpha = exp2(m - m_new); acc = acc * alpha + dot(P codes, v codes) * f; l = l * alpha + sum(codes) * f
  out = (acc * v_scale) / l (v_scale 1 for a bf16 V), rounded once to the output dtype (RNE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowbit.ops import attention_reference as ar
from lowbit.ops.kernels.attention_call import CacheOperand, prefill_refusal
from lowbit.ops.kv_quant import KVQuant

from .attention import _OUT, SM90_SHARED, _shared_limit, check_call, codes_as, p_codes, smem_bytes, softmax_block
from .common import cast_out, check_device, interpreting, launch

_KIND = {"fp8_e4m3fn": 0, "int8": 1}        # code kinds (codes_as'); 2 = a bf16 cache
_P_MODE = {"fp8_e4m3fn": 0, "int8": 1}      # the formats of kernels.attention_call.CODE_FORMATS


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill kernel's launch knobs (the tuner times prefill_candidates and picks one):
    block_m query tokens per program, num_warps (4 = one Hopper warpgroup, 8 = two), num_stages
    of software pipelining of the K / V loads. The key block is spec.p_block (a numerical choice)."""

    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        if self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"PrefillConfig: block_m must be a power of two in 16..256, got {self.block_m}")
        if self.num_warps not in (4, 8):
            raise ValueError(f"PrefillConfig: num_warps must be 4 or 8, got {self.num_warps}")
        if self.num_stages not in (1, 2, 3, 4):
            raise ValueError(f"PrefillConfig: num_stages must be 1..4, got {self.num_stages}")

    def __str__(self) -> str:
        return f"m{self.block_m}w{self.num_warps}s{self.num_stages}"


# FA2 / the Triton tutorial on sm_90 at head_dim 64-128: 128 query rows over two warpgroups (one
# wgmma M=64 tile each), 2-3 stages; 64 rows over one or two warpgroups for short prompts and head_dim
# 256. 128 rows over 4 warps is left out: at head_dim 128 its sm_90 code spills (~850 local loads /
# stores); every listed one compiles without spills at Llama-3-8B's prefill shapes (T 300 and 2048)
_CANDIDATES = [PrefillConfig(128, 8, 2), PrefillConfig(128, 8, 3), PrefillConfig(64, 4, 3), PrefillConfig(64, 4, 2),
               PrefillConfig(64, 8, 2), PrefillConfig(64, 8, 3), PrefillConfig(128, 8, 1), PrefillConfig(64, 4, 1)]


def _fits(cfg: PrefillConfig, D: int, p_block: int, limit: int = SM90_SHARED) -> bool:
    bd = max(16, triton.next_power_of_2(D))
    return smem_bytes(cfg.block_m, p_block, bd, True, 1, 1, False, False, cfg.num_stages) <= limit


def prefill_candidates(D: int, Tq: int, p_block: int = 64) -> list[PrefillConfig]:
    """At most 8 configurations worth timing for head_dim D, Tq query tokens and P block p_block
    (those whose shared memory fits one sm_90 block; 128-row tiles only when Tq > 64)."""
    out = [c for c in _CANDIDATES if _fits(c, D, p_block) and (c.block_m <= 64 or Tq > 64)]
    return out or [PrefillConfig(64, 4, 1)]


def default_config(D: int, Tq: int, p_block: int = 64) -> PrefillConfig:
    """The heuristic where no tuning table decides: 128 rows over two warpgroups up to head_dim 128;
    64 rows over one above it (a 128-row fp32 accumulator of a 256-wide head would spill)."""
    cands = prefill_candidates(D, Tq, p_block)
    if D > 128:
        cands = [c for c in cands if c.block_m <= 64] or cands
    return cands[0]


@triton.jit
def _tile(ptr, base, offs_t, offs_d, T, D, st_t, st_d, KIND: tl.constexpr, MASK_T: tl.constexpr,
          EVEN_D: tl.constexpr, FAST_FP8: tl.constexpr, DOT_TY: tl.constexpr):
    """[BLOCK_N, BLOCK_D] codes (or bf16 values) of one KV head in DOT_TY, exact; masked loads only
    where the tile may leave [0, T) x [0, D)."""
    ptrs = ptr + base + offs_t[:, None] * st_t + offs_d[None, :] * st_d
    if MASK_T:
        if EVEN_D:
            raw = tl.load(ptrs, mask=(offs_t < T)[:, None], other=0)
        else:
            raw = tl.load(ptrs, mask=(offs_t < T)[:, None] & (offs_d < D)[None, :], other=0)
    elif EVEN_D:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=(offs_d < D)[None, :], other=0)
    return codes_as(raw, KIND, FAST_FP8, DOT_TY)


@triton.jit
def _p_operand(x, P_MODE: tl.constexpr, FAST_FP8: tl.constexpr, DOT_TY: tl.constexpr):
    """(P codes in DOT_TY for the P.V dot, the same codes in fp32 for l) of x = fmt_max * exp2(t - mb)."""
    if P_MODE == 0 and FAST_FP8:
        c = x.to(tl.float8e4nv).to(DOT_TY)          # cvt.rn.satfinite, then e4m3 -> fp16 exactly
        return c, c.to(tl.float32)
    c = p_codes(x, P_MODE, FAST_FP8)
    return c.to(DOT_TY), c


@triton.jit
def _block(acc, l_i, m_i, q, r, k_ptr, ks_ptr, v_ptr, k_base, ks_base, v_base, start, offs_n, offs_d, offs_m,
           Tq, Tk, D, sk_t, sk_d, sks_t, sv_t, sv_d,
           K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_TOKEN: tl.constexpr, P_MODE: tl.constexpr,
           FMAX: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, FAST_FP8: tl.constexpr,
           DOT_TY: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_D: tl.constexpr):
    """One key block of the online softmax (module docstring); MASKED: the diagonal / tail blocks."""
    offs_k = start + offs_n
    kt = _tile(k_ptr, k_base, offs_k, offs_d, Tk, D, sk_t, sk_d, K_KIND, MASKED, EVEN_D, FAST_FP8, DOT_TY)
    t = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * r[:, None]
    if K_TOKEN:
        if MASKED:
            ks = tl.load(ks_ptr + ks_base + offs_k * sks_t, mask=offs_k < Tk, other=0.0)
        else:
            ks = tl.load(ks_ptr + ks_base + offs_k * sks_t)
        t = t * ks[None, :]
    if MASKED:
        seen = (offs_k < Tk)[None, :] & (offs_m >= 0)[:, None]
        if CAUSAL:
            seen = seen & (offs_k[None, :] <= offs_m[:, None] + (Tk - Tq))
        m_new, codes, f, alpha = softmax_block(t, seen, m_i, FMAX, P_MODE, FAST_FP8)
        p_dot = codes.to(DOT_TY)
    else:
        mb = tl.max(t, axis=1)                      # finite: every key of the block is seen
        m_new = tl.maximum(m_i, mb)
        p_dot, codes = _p_operand(tl.exp2(t - mb[:, None]) * FMAX, P_MODE, FAST_FP8, DOT_TY)
        f = tl.math.div_rn(tl.exp2(mb - m_new), FMAX)
        alpha = tl.exp2(m_i - m_new)                # 0 on the first block (m_i = -inf)
    vt = _tile(v_ptr, v_base, offs_k, offs_d, Tk, D, sv_t, sv_d, V_KIND, MASKED, EVEN_D, FAST_FP8, DOT_TY)
    pv = tl.dot(p_dot, vt, input_precision=DOT_PREC)
    acc = acc * alpha[:, None] + pv * f[:, None]
    l_i = l_i * alpha + tl.sum(codes, axis=1) * f
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, Tq, Tk, D, G, c, NM,
                    sq_b, sq_h, sq_t, sq_d, sqs_b, sqs_h, sqs_t,
                    sk_b, sk_h, sk_t, sk_d, sks_b, sks_h, sks_t,
                    sv_b, sv_h, sv_t, sv_d, svs_b, svs_h,
                    so_b, so_h, so_t, so_d, Hq,
                    K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_TOKEN: tl.constexpr, P_MODE: tl.constexpr,
                    FMAX: tl.constexpr, CAUSAL: tl.constexpr, FAST_FP8: tl.constexpr, DOT_TY: tl.constexpr,
                    DOT_PREC: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, OUT_TY: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_m = NM - 1 - tl.program_id(1)          # the longest causal key loops first
    b = (pid_bh // Hq).to(tl.int64)             # 64-bit batch offsets: a cache past 2^31 bytes per layer
    h = pid_bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Tq
    q_ok = row_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_ok, other=0.0)
    q = q.to(DOT_TY)                            # code values (or bf16 data): exact
    qs = tl.load(qs_ptr + b * sqs_b + h * sqs_h + offs_m * sqs_t, mask=row_ok, other=1.0)
    r = qs * c
    ks_base = b * sks_b + hk * sks_h
    if not K_TOKEN:
        r = r * tl.load(ks_ptr + ks_base)
    k_base = b * sk_b + hk * sk_h
    v_base = b * sv_b + hk * sv_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        # keys every row of the tile sees: j <= m0 + Tk - Tq; the tile's last row sees up to hi - 1
        hi = tl.minimum(Tk, tl.minimum(m0 + BLOCK_M, Tq) + Tk - Tq)
        lo = (tl.minimum(m0 + 1 + Tk - Tq, Tk) // BLOCK_N) * BLOCK_N
    else:
        hi = Tk + tl.zeros([], tl.int32)
        lo = (Tk // BLOCK_N) * BLOCK_N
    for start in range(0, lo, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, r, k_ptr, ks_ptr, v_ptr, k_base, ks_base, v_base, start, offs_n,
                               offs_d, offs_m, Tq, Tk, D, sk_t, sk_d, sks_t, sv_t, sv_d, K_KIND, V_KIND, K_TOKEN,
                               P_MODE, FMAX, False, CAUSAL, FAST_FP8, DOT_TY, DOT_PREC, EVEN_D)
    for start in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, r, k_ptr, ks_ptr, v_ptr, k_base, ks_base, v_base, start, offs_n,
                               offs_d, offs_m, Tq, Tk, D, sk_t, sk_d, sks_t, sv_t, sv_d, K_KIND, V_KIND, K_TOKEN,
                               P_MODE, FMAX, True, CAUSAL, FAST_FP8, DOT_TY, DOT_PREC, EVEN_D)
    vs = tl.load(vs_ptr + b * svs_b + hk * svs_h)
    out = tl.math.div_rn(acc * vs, tl.where(l_i > 0, l_i, 1.0)[:, None])
    tl.store(o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :] * so_d,
             cast_out(out, OUT_TY), mask=q_ok)


def _operand(t, name: str):
    """(codes or bf16 values [B, H, T, D], scale [B, H, T] view (zero strides where constant), kind)."""
    if isinstance(t, KVQuant):
        check_device(f"{name}.codes", t.codes)
        return t.codes, t.scale_bhtg()[..., 0], _KIND[t.scheme.format]
    check_device(name, t)
    B, H, T, _ = t.shape
    return t, torch.ones(1, 1, 1, dtype=torch.float32, device=t.device).expand(B, H, T), 2


def prefill_attention(q_vals: torch.Tensor, k, v, spec: ar.AttnSpec, *, q_scale: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32, config: PrefillConfig | None = None) -> torch.Tensor:
    """q_vals: [B, Hq, Tq, D] Q's code values (fp32, with q_scale fp32 [B, Hq, Tq, 1]) or bf16 Q
    (q_scale None); k, v: KVQuant or bf16 [B, Hkv, Tk, D] as lowbit.ops.kernels.attention_call.prefill_refusal
    allows. config: the launch knobs (default_config when None). Returns [B, Hq, Tq, D] in out_dtype."""
    G, q_scale, q_exact = check_call(q_vals, k, v, spec, q_scale, out_dtype)
    B, Hq, Tq, D = q_vals.shape
    Tk = k.shape[2]
    why = prefill_refusal(q_exact, CacheOperand.of(k), CacheOperand.of(v), spec)
    if why is not None:
        raise ValueError(f"the prefill kernel cannot run this call: {why}; use lowbit.ops.triton.attention."
                         "flash_attention (kernel='flash')")
    cfg = config or default_config(D, Tq, spec.p_block)
    kc, ks, kk = _operand(k, "k")
    vc, vs, vk = _operand(v, "v")
    bd = max(16, triton.next_power_of_2(D))
    limit = SM90_SHARED if interpreting() else _shared_limit(q_vals.device.index or 0)
    need = smem_bytes(cfg.block_m, spec.p_block, bd, True, kc.element_size(), vc.element_size(), False, False,
                      cfg.num_stages)
    if need > limit:
        raise ValueError(f"prefill config {cfg} needs ~{need} bytes of shared memory at head_dim {D}, p_block "
                         f"{spec.p_block} (limit {limit}): pick one of prefill_candidates()")
    out = torch.empty(B, Hq, Tq, D, dtype=out_dtype, device=q_vals.device)
    c = float(torch.tensor(spec.scale_for(D) * ar.LOG2E, dtype=torch.float32))
    codes_only = q_vals.dtype != torch.bfloat16 and kk != 2 and vk != 2
    # fp16 holds every code exactly; bf16 where Q or the cache is bf16 data; Triton 3.6's interpreter
    # multiplies 16-bit dot operands wrongly, so there fp32 holds the same exact values
    dot_ty = tl.float32 if interpreting() else tl.float16 if codes_only else tl.bfloat16
    nm = triton.cdiv(Tq, cfg.block_m)
    launch(_prefill_kernel, (B * Hq, nm), q_vals, q_scale, kc, ks, vc, vs, out, Tq, Tk, D, G, c, nm,
           *q_vals.stride(), *q_scale.stride()[:3], *kc.stride(), *ks.stride(), *vc.stride(), *vs.stride()[:2],
           *out.stride(), Hq,
           K_KIND=kk, V_KIND=vk, K_TOKEN=isinstance(k, KVQuant) and k.scheme.granularity == "token",
           P_MODE=_P_MODE[spec.p_format], FMAX=float(spec.p_max), CAUSAL=spec.causal, FAST_FP8=not interpreting(),
           DOT_TY=dot_ty, DOT_PREC="ieee" if interpreting() else "tf32", EVEN_D=bd == D,
           BLOCK_M=cfg.block_m, BLOCK_N=spec.p_block, BLOCK_D=bd, OUT_TY=_OUT[out_dtype],
           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
