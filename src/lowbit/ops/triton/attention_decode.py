"""Split-KV (flash-decoding) attention over a quantized KV cache, Triton: decode steps and short
query blocks (G * Tq <= MAX_ROWS rows per KV head).

Grid (batch x KV head, split). A program takes the G = Hq // Hkv query heads of one KV head with
their Tq tokens as rows (row = g * Tq + i, padded to BLOCK_M >= 16), so each K / V tile is read
once for the whole group and the scores are one [BLOCK_M, D] x [D, BLOCK_N] tensor-core dot.
Split s covers keys [s * SPLIT, min((s + 1) * SPLIT, Tk)) with SPLIT a multiple of BLOCK_N =
p_block: a split boundary is always a P block boundary, so every P block (the reference's
per-(row, key block) scale) lies inside one split and its codes are the reference's. The number
of splits fills one wave of the GPU (pick_splits); a second small kernel merges them.

The cache is read as stored: fp8 e4m3 bit patterns or int8 values, one scale per tensor, KV head
or (batch, head, token) (zero-stride views), or a bf16 cache. Codes are exact in fp16 (the dots'
operand type where every operand is a code; bf16 where Q or the cache is bf16 data), so the dots
take them as they are and the scales come after: K's on the scores, V's per tensor / head on each
split's O. Q is quantized here, per (token, head) = per row, as lowbit.quantize does (absmax
scale, IEEE division, round-half-even), unless its codes are handed over.
Arithmetic, in this order (lowbit.ops.attention_reference derives the gate):
  t = dot(q codes, k codes) * (q_scale * c [* k_scale per tensor / head]) [* k_scale per token]:
      D exact products summed in fp32 plus three multiplies (the gate's gamma_{D+5} counts these, c's
      own rounding and Q_hat / K_hat's dequantizing roundings)
  masked t = -inf; mb = row max of the block; P codes = grid(fmt_max * exp2(t - mb)) (RNE;
      fp8 by the GPU's cvt.rn.satfinite or, in the interpreter, encode_e4m3fn; int8 by rint and
      clamp), f = exp2(mb - m_new) / fmt_max
  pv = dot(P codes, v codes) (exact products, fp32 sums); where V is scaled per token or P is
      kept in fp32, the weights w = P * v_scale (fp32, the one rounding the reference's V_hat
      has) are split into three bf16 pieces hi + mid + lo (each fp32 subtraction exact; the
      residual is below 2^-26 |w|) and pv is three dots into one fp32 accumulator
  O = O * alpha + pv * f, l = l * alpha + sum(P codes) * f, alpha = exp2(m_old - m_new) (fp32)
  end of split: O *= v_scale (per tensor / head); one split: out = O / l, rounded once (RNE)
  merge: M = max_s m_s, e_s = exp2(m_s - M) (0 for a split no key of the row reached: causal
      rows of a query block), out = (sum_s e_s O_s) / (sum_s e_s l_s) (fp32)
Against the reference's gate: a weight passes through at most nb + 1 exp2 factors (its block's f,
the rescales inside its split, e_s) whose arguments telescope to M - mb, the same factors reach O
and l, and its O term takes at most BLOCK_N + 2 nb + 6 fp32 roundings (dot sums, the three dots'
merge, f, two per block inside a split, e_s and the S - 1 merge additions with S <= nb, V's scale,
the division): within the (2 nb + 4) exp2 errors and gamma_{BLOCK_N + 2 nb + 8} the gate allows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops import attention_reference as ar
from lowbit.ops.kernels.attention_call import SPLIT_KV_MAX_ROWS, kv_kind
from lowbit.ops.kv_quant import KVQuant

from .attention import code_tile, softmax_block
from .common import cast_out, check_device, decode_e4m3fn, interpreting, launch, num_sms
from .fused_quant import _codes as _quant_codes
from .fused_quant import _group_scales

MAX_ROWS = SPLIT_KV_MAX_ROWS      # G * Tq rows one program holds; more goes to the prefill kernel
MAX_HEAD_DIM = 256
MIN_BLOCKS_PER_SPLIT = 4        # keys per split >= 4 p_blocks: enough loop trips to pipeline the loads
# split programs resident per SM by warps, from the sm_90 compile at head_dim 128 (registers, shared
# memory): 1 warp 255 registers / 37 KB -> 6; 2 warps 255 / 39 KB -> 4; 4 warps 168 / 39 KB -> 3
RESIDENT = {1: 6, 2: 4, 4: 3, 8: 1}
STAGES = 3
_P_MODE = {"fp8_e4m3fn": 0, "int8": 1, None: 2}
_Q_FMT = {"int8": 0, "fp8_e4m3fn": 1}      # fused_quant's element-format numbers; 2 = Q given
_OUT = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _split_kernel(q_ptr, qs_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, op_ptr, mp_ptr, lp_ptr,
                  Tq, Tk, D, G, c, SPLIT, NSPLIT,
                  sq_b, sq_h, sq_t, sq_d, sqs_b, sqs_h, sqs_t,
                  sk_b, sk_h, sk_t, sk_d, sks_b, sks_h, sks_t,
                  sv_b, sv_h, sv_t, sv_d, svs_b, svs_h, svs_t,
                  so_b, so_h, so_t, so_d, Hq, Hkv,
                  Q_FMT: tl.constexpr, QMAX: tl.constexpr,
                  K_KIND: tl.constexpr, V_KIND: tl.constexpr, K_TOKEN: tl.constexpr, V_TOKEN: tl.constexpr,
                  P_MODE: tl.constexpr, FMAX: tl.constexpr, CAUSAL: tl.constexpr, PV_SPLIT: tl.constexpr,
                  FINAL: tl.constexpr, FAST_FP8: tl.constexpr, SPLIT3: tl.constexpr, QK_TY: tl.constexpr,
                  PV_TY: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, OUT_TY: tl.constexpr):
    pid_bh = tl.program_id(0)
    sid = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)        # batch offsets in 64 bits: a cache past 2^31 bytes per layer
    hk = pid_bh % Hkv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * Tq
    h = hk * G + rows // Tq
    qi = rows % Tq
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D
    q_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + qi[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_ok, other=0.0)
    if Q_FMT == 2:                           # Q's code values with their scales, or bf16 Q: exact in QK_TY
        q_in = q.to(QK_TY)
        qs = tl.load(qs_ptr + b * sqs_b + h * sqs_h + qi * sqs_t, mask=row_ok, other=1.0)
    else:                                    # Q quantized here per (token, head) = per row, as lowbit.quantize
        y = q.to(tl.float32)
        qs, _ = _group_scales(tl.max(tl.abs(y), axis=1), qs_ptr, 0, 0, QMAX, 0, 0, 0)
        qc = _quant_codes(y, qs[:, None], Q_FMT, 0, QMAX, False, True)
        if Q_FMT == 1:
            q_in = decode_e4m3fn(qc.to(tl.int32)).to(QK_TY)
        else:
            q_in = qc.to(tl.float32).to(QK_TY)
    rf = qs * c
    if not K_TOKEN:
        rf = rf * tl.load(ks_ptr + b * sks_b + hk * sks_h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = sid * SPLIT
    hi = tl.minimum(lo + SPLIT, Tk)
    for start in range(lo, hi, BLOCK_N):
        offs_k = start + offs_n
        k_ok = offs_k < Tk
        kt = code_tile(k_ptr, b, hk, offs_k, offs_d, Tk, D, sk_b, sk_h, sk_t, sk_d, K_KIND, FAST_FP8, EVEN_D, QK_TY)
        t = tl.dot(q_in, tl.trans(kt), input_precision=DOT_PREC) * rf[:, None]
        if K_TOKEN:
            ks = tl.load(ks_ptr + b * sks_b + hk * sks_h + offs_k * sks_t, mask=k_ok, other=0.0)
            t = t * ks[None, :]
        # padding rows (q = 0) run a harmless softmax of their own and are never stored
        if CAUSAL:
            seen = offs_k[None, :] <= qi[:, None] + (Tk - Tq)       # implies offs_k < Tk
        else:
            seen = k_ok[None, :] & (qi >= 0)[:, None]
        m_next, codes, f, alpha = softmax_block(t, seen, m_i, FMAX, P_MODE, FAST_FP8)
        vt = code_tile(v_ptr, b, hk, offs_k, offs_d, Tk, D, sv_b, sv_h, sv_t, sv_d, V_KIND, FAST_FP8, EVEN_D, PV_TY)
        if PV_SPLIT:
            w = codes
            if V_TOKEN:
                vsc = tl.load(vs_ptr + b * svs_b + hk * svs_h + offs_k * svs_t, mask=k_ok, other=0.0)
                w = w * vsc[None, :]
            if SPLIT3:
                # w = hi + mid + lo in bf16 (each remainder exact in fp32), smallest piece first
                w_hi = w.to(PV_TY)
                r = w - w_hi.to(tl.float32)
                w_mid = r.to(PV_TY)
                w_lo = (r - w_mid.to(tl.float32)).to(PV_TY)
                pv = tl.dot(w_lo, vt, input_precision=DOT_PREC)
                pv = tl.dot(w_mid, vt, pv, input_precision=DOT_PREC)
                pv = tl.dot(w_hi, vt, pv, input_precision=DOT_PREC)
            else:
                pv = tl.dot(w.to(PV_TY), vt, input_precision=DOT_PREC)
        else:
            pv = tl.dot(codes.to(PV_TY), vt, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv * f[:, None]
        l_i = l_i * alpha + tl.sum(codes, axis=1) * f
        m_i = m_next
    if not V_TOKEN:
        acc = acc * tl.load(vs_ptr + b * svs_b + hk * svs_h)
    if FINAL:
        out = tl.math.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None])
        tl.store(o_ptr + b * so_b + h[:, None] * so_h + qi[:, None] * so_t + offs_d[None, :] * so_d,
                 cast_out(out, OUT_TY), mask=q_ok)
    else:
        prow = ((b * Hq + h) * Tq + qi) * NSPLIT + sid       # partials [B, Hq, Tq, NSPLIT, (D)]
        tl.store(op_ptr + prow[:, None] * D + offs_d[None, :], acc, mask=q_ok)
        tl.store(mp_ptr + prow, m_i, mask=row_ok)
        tl.store(lp_ptr + prow, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(op_ptr, mp_ptr, lp_ptr, o_ptr, Hq, Tq, D, NSPLIT, so_b, so_h, so_t, so_d,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, OUT_TY: tl.constexpr):
    """One output row from its splits' (m, l, O): the log-sum-exp merge in fp32."""
    r = tl.program_id(0)
    qi = r % Tq
    h = (r // Tq) % Hq
    b = r // (Tq * Hq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NSPLIT
    m = tl.load(mp_ptr + r * NSPLIT + offs_s, mask=s_ok, other=float("-inf"))
    l = tl.load(lp_ptr + r * NSPLIT + offs_s, mask=s_ok, other=0.0)
    mx = tl.max(m, axis=0)
    e = tl.where(m > float("-inf"), tl.exp2(m - mx), 0.0)      # a split no key of this row reached: 0
    ok = s_ok[:, None] & (offs_d < D)[None, :]
    o = tl.load(op_ptr + (r * NSPLIT + offs_s)[:, None] * D + offs_d[None, :], mask=ok, other=0.0)
    acc = tl.sum(o * e[:, None], axis=0)
    den = tl.sum(l * e, axis=0)
    out = tl.math.div_rn(acc, tl.where(den > 0, den, 1.0))
    tl.store(o_ptr + b * so_b + h * so_h + qi * so_t + offs_d * so_d, cast_out(out, OUT_TY), mask=offs_d < D)


def launch_warps(block_m: int, programs: int = 1) -> int:
    """Warps of a split program: 8 above a 16-row tile; at 16 rows 4, or 2 once the (batch x KV
    head) programs alone fill half the SMs' slots (B * Hkv >= 64): on the H200 at 32k keys, B=16
    x 8 KV heads ran 1.57x bf16 SDPA at 2 warps against 1.40x at 4, while B=1 ran best at 4
    (1.31x vs 1.27x): more, smaller programs per SM hide the cache loads' latency once there are
    enough of them. No register spills at head_dim 128 either way (tests/ops/test_attention_sm90.py)."""
    if block_m > 16:
        return 8
    return 2 if programs >= 64 else 4


def pick_splits(B: int, Hkv: int, Tk: int, block_n: int, sms: int, per_sm: int = RESIDENT[4]) -> tuple[int, int]:
    """(keys per split, splits): as many splits as one wave of resident programs holds (per_sm
    per SM, RESIDENT), so no second, partly empty wave follows; each split a whole number of key
    blocks (a split boundary is a P block boundary) and at least MIN_BLOCKS_PER_SPLIT of them,
    none empty."""
    nblocks = triton.cdiv(Tk, block_n)
    s = max(1, min(per_sm * sms // (B * Hkv), nblocks // MIN_BLOCKS_PER_SPLIT))
    per = triton.cdiv(nblocks, s)
    return per * block_n, triton.cdiv(nblocks, per)


def _operand(t, name: str, B: int, H: int, T: int):
    """(codes or bf16 values, scale [B, H, T, 1] with zero strides, kind: 0 fp8, 1 int, 2 bf16)."""
    if isinstance(t, KVQuant):
        if t.scheme.granularity == "group":
            raise ValueError(f"{name}: split-KV attention takes scales per tensor, head or token, not per head-dim "
                             "group (the prefill kernel lowbit.ops.triton.attention.flash_attention does)")
        check_device(f"{name}.codes", t.codes)
        return t.codes, t.scale_bhtg(), 0 if t.scheme.fmt.kind == "float" else 1
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name}: an unquantized cache must be bfloat16 here (exact in the tensor-core dot), got "
                         f"{t.dtype}; flash_attention takes float32 / float16 caches")
    check_device(name, t)
    return t, torch.ones(1, 1, 1, 1, dtype=torch.float32, device=t.device).expand(B, H, T, 1), 2


def split_kv_attention(q: torch.Tensor, k, v, spec: ar.AttnSpec, *, q_scale: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32, splits: int | None = None,
                       warps: int | None = None) -> torch.Tensor:
    """q [B, Hq, Tq, D]: the float queries, quantized in the kernel per (token, head) by
    spec.q_format exactly as lowbit.quantize does (bf16 when q_format is None); or, with q_scale
    [B, Hq, Tq, 1] fp32, Q's code values. k, v: KVQuant (scales per tensor / head / token) or bf16
    [B, Hkv, Tk, D]. Needs G * Tq <= MAX_ROWS. splits: None = pick_splits. Returns [B, Hq, Tq, D]
    in out_dtype. warps: the split program's warps (None = launch_warps; benchmarks sweep it)."""
    check_device("q", q)
    G = ar.check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if G * Tq > MAX_ROWS:
        raise ValueError(f"split-KV attention holds G * Tq <= {MAX_ROWS} rows per KV head, got {G} x {Tq}: "
                         "use flash_attention (the prefill kernel)")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}: use backend='torch'")
    if out_dtype not in _OUT:
        raise ValueError(f"out_dtype must be one of {list(_OUT)}, got {out_dtype}")
    if spec.causal and Tk < Tq:
        ar.allowed_mask(Tq, Tk, True)                          # raises the reference's error
    interp = interpreting()
    q_fmt = 2 if q_scale is not None or spec.q_format is None else _Q_FMT[spec.q_format]
    q_bf16 = q_fmt == 2 and q_scale is None                    # unquantized bf16 queries
    if q_scale is None:
        if q_fmt == 2 and q.dtype != torch.bfloat16:
            raise ValueError(f"q: with q_format None the queries must be bfloat16 (exact in the tensor-core dot), "
                             f"got {q.dtype}; quantize them (AttnSpec q_format) or use flash_attention")
        q_scale = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=q.device).expand(B, Hq, Tq, 1)
    elif q_scale.shape != (B, Hq, Tq, 1) or q_scale.dtype != torch.float32:
        raise ValueError(f"q_scale must be float32 [B, Hq, Tq, 1] = {(B, Hq, Tq, 1)}, got {q_scale.dtype} "
                         f"{tuple(q_scale.shape)}")
    kc, ks, kk = _operand(k, "k", B, Hkv, Tk)
    vc, vs, vk = _operand(v, "v", B, Hkv, Tk)
    k_token = kv_kind(k) == "token"
    v_token = kv_kind(v) == "token"
    pv_split = v_token or spec.p_format is None
    bn = spec.p_block
    bm = max(16, triton.next_power_of_2(G * Tq))
    warps = warps or launch_warps(bm, B * Hkv)
    if splits is None:
        split, ns = pick_splits(B, Hkv, Tk, bn, num_sms(), RESIDENT.get(warps, 1))
    else:
        if not isinstance(splits, int) or splits < 1:
            raise ValueError(f"splits must be a positive int, got {splits!r}")
        per = triton.cdiv(triton.cdiv(Tk, bn), splits)
        split, ns = per * bn, triton.cdiv(triton.cdiv(Tk, bn), per)
    # dot operand types: fp16 holds every code exactly and converts from e4m3 in one instruction per
    # pair; bf16 where an operand is bf16 data or a bf16 piece of a split fp32 weight (fp16's range
    # would lose small pieces); Triton 3.6's interpreter multiplies 16-bit dot operands wrongly, so
    # there fp32 holds the same exact values
    qk_ty = tl.float32 if interp else tl.bfloat16 if kk == 2 or q_bf16 else tl.float16
    pv_ty = tl.float32 if interp else tl.bfloat16 if vk == 2 or pv_split else tl.float16
    bd = max(16, triton.next_power_of_2(D))
    out = torch.empty(B, Hq, Tq, D, dtype=out_dtype, device=q.device)
    if ns > 1:
        opart = torch.empty(B, Hq, Tq, ns, D, dtype=torch.float32, device=q.device)
        mpart = torch.empty(B, Hq, Tq, ns, dtype=torch.float32, device=q.device)
        lpart = torch.empty_like(mpart)
    else:
        opart = mpart = lpart = out                            # not read: the split writes the output
    c = float(torch.tensor(spec.scale_for(D) * ar.LOG2E, dtype=torch.float32))
    q_in = q.to(torch.float32) if interp and q.dtype == torch.bfloat16 else q
    qmax = 0.0 if q_fmt == 2 else float(448.0 if q_fmt == 1 else 127.0)
    launch(_split_kernel, (B * Hkv, ns), q_in, q_scale, kc, ks, vc, vs, out, opart, mpart, lpart,
           Tq, Tk, D, G, c, split, ns, *q_in.stride(), *q_scale.stride()[:3],
           *kc.stride(), *ks.stride()[:3], *vc.stride(), *vs.stride()[:3], *out.stride(), Hq, Hkv,
           Q_FMT=q_fmt, QMAX=qmax, K_KIND=kk, V_KIND=vk, K_TOKEN=k_token, V_TOKEN=v_token,
           P_MODE=_P_MODE[spec.p_format], FMAX=float(spec.p_max), CAUSAL=spec.causal and Tq > 1, PV_SPLIT=pv_split,
           FINAL=ns == 1, FAST_FP8=not interp, SPLIT3=not interp, QK_TY=qk_ty, PV_TY=pv_ty,
           DOT_PREC="ieee" if interp else "tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, EVEN_D=D == bd,
           OUT_TY=_OUT[out_dtype], num_warps=warps, num_stages=STAGES)
    if ns > 1:
        launch(_merge_kernel, (B * Hq * Tq,), opart, mpart, lpart, out, Hq, Tq, D, ns, *out.stride(),
               BLOCK_S=max(2, triton.next_power_of_2(ns)), BLOCK_D=bd, OUT_TY=_OUT[out_dtype], num_warps=4)
    return out
