"""Float64 quantization-aware attention reference and its derived gate.

What a quantized attention kernel computes (lowbit.ops.attention's torch path and the Triton
kernel both follow it; the reference is the same algorithm in float64, exact up to 2^-53):
  Q_hat = q dequantized from its per-(token, head) codes (or q itself), K_hat / V_hat from the
  cache (lowbit.ops.kv_quant); t_ij = (Q_hat_i . K_hat_j) * sm_scale * log2(e) (log2 units);
  keys are masked before anything else (causal: key j is seen by query i when
  j <= i + Tk - Tq, the bottom-right alignment a decode step with a cache needs).
  Keys are cut in blocks of p_block; per query row and block, mb = max_j t_ij and
    P codes  c_ij = grid(fmt_max * 2^(t_ij - mb))          (P scaled per (row, block), never per tensor)
    weights  w_ij = c_ij / fmt_max * 2^(mb - m)            (m: the running max, then rescaled)
  O accumulates sum_j w_ij V_hat_j and l accumulates sum_j w_ij, both in fp32 and both rescaled
  by 2^(m_old - m_new) when the running max grows; out = O / l. Because the codes depend only on
  t - mb, they do not depend on the order the running max is found in, so the reference needs no
  kernel schedule. l sums the quantized weights: out is a convex combination of V_hat's rows.

Variants (`variant=`) simulate named bugs exactly (lowbit.verify.attention uses them):
  p_per_tensor          P codes = grid(fmt_max * 2^(t - m_running)): one scale for all of P
  acc_bf16 / acc_fp16   O rounded to bf16 / fp16 after every block update (low-precision O)
  rescale_skipped       neither O nor l multiplied by 2^(m_old - m_new)
  rescale_wrong_acc     the factor applied to l only, never to O
  causal_after_p        the block max and codes taken before the causal mask, masked P zeroed after
The cache-side bugs (a per-head scale read per tensor, the V scale forgotten, another layer's
scale) are simulated by editing K_hat / V_hat before calling attention_reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import lowbit.quantize as Q
from lowbit.formats import decode, encode, get_format
from lowbit.scheme import QuantScheme

LOG2E = 1.0 / math.log(2.0)
U32 = 2.0 ** -24
U64 = 2.0 ** -53
# A computed exp2 in log2 units: PTX ex2.approx.f32 has relative error <= 2^-22 (and the
# interpreter's numpy exp2 <= 2^-23), i.e. |log2(computed / exact)| <= 2^-22 / ln 2 < 2^-21; doubled
# for the argument's own rounding into the instruction.
EXP2_ERR = 2.0 ** -20
P_FORMATS = ("fp8_e4m3fn", "int8", None)
Q_FORMATS = ("fp8_e4m3fn", "int8", None)
VARIANTS = (None, "p_per_tensor", "acc_bf16", "acc_fp16", "rescale_skipped", "rescale_wrong_acc", "causal_after_p")
_NO_RESCALE_O = ("rescale_skipped", "rescale_wrong_acc")
_LOW = {"acc_bf16": (torch.bfloat16, 2.0 ** -8), "acc_fp16": (torch.float16, 2.0 ** -11)}
_OUT_UNITS = {torch.float32: (2.0 ** -24, 2.0 ** -149), torch.float16: (2.0 ** -11, 2.0 ** -24),
              torch.bfloat16: (2.0 ** -8, 2.0 ** -133), torch.float64: (U64, 0.0)}


@dataclass(frozen=True)
class AttnSpec:
    """How attention is quantized.

    q_format: per-(token, head) dynamic quantization of Q ("fp8_e4m3fn" | "int8") or None.
    p_format: P's codes ("fp8_e4m3fn" | "int8") or None (P kept in fp32).
    p_block:  keys per P scale (the kernel's key block; a power of two >= 16).
    causal:   bottom-right causal mask.
    sm_scale: softmax scale; None = 1 / sqrt(head_dim).
    qk_acc / pv_acc: what the kernel accumulates Q.K^T and P.V in (ACCUMULATORS): "fp32";
              "fp8_fast" (Hopper's fp8 tensor-core accumulator: 32-wide steps keeping 14
              significant bits, truncated); "bf16" / "fp16" (rounded after every product).
    pv_promote: keys of P.V summed in pv_acc before the partial is added into an fp32 O (a
              multiple of 32 for fp8_fast; FlashAttention-3's fix promotes once per key block);
              0 = never: the narrow accumulator holds O across the whole context.
    """

    q_format: str | None = "fp8_e4m3fn"
    p_format: str | None = "fp8_e4m3fn"
    p_block: int = 64
    causal: bool = True
    sm_scale: float | None = None
    qk_acc: str = "fp32"
    pv_acc: str = "fp32"
    pv_promote: int = 0

    def __post_init__(self):
        if self.q_format not in Q_FORMATS:
            raise ValueError(f"AttnSpec: q_format must be one of {Q_FORMATS}, got {self.q_format!r}")
        if self.p_format not in P_FORMATS:
            raise ValueError(f"AttnSpec: p_format must be one of {P_FORMATS}, got {self.p_format!r}")
        b = self.p_block
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"AttnSpec: p_block must be a power of two >= 16 (it is the kernel's key block), got {b!r}")
        for name in ("qk_acc", "pv_acc"):
            if getattr(self, name) not in ACCUMULATORS:
                raise ValueError(f"AttnSpec: {name} must be one of {ACCUMULATORS}, got {getattr(self, name)!r}")
        n = self.pv_promote
        if not isinstance(n, int) or n < 0 or (self.pv_acc == "fp8_fast" and n % FP8_STEP):
            raise ValueError(f"AttnSpec: pv_promote must be 0 (never) or a number of keys >= 1 (a multiple of "
                             f"{FP8_STEP} for fp8_fast, whose steps are {FP8_STEP} keys), got {n!r}")

    def scale_for(self, D: int) -> float:
        return 1.0 / math.sqrt(D) if self.sm_scale is None else float(self.sm_scale)

    @property
    def p_max(self) -> float:
        return 1.0 if self.p_format is None else float(get_format(self.p_format).max)

    def pv_stretch(self, Tk: int) -> int:
        """Keys P.V sums in pv_acc before an fp32 promotion (the whole context when never)."""
        return Tk if self.pv_acc == "fp32" or self.pv_promote == 0 else min(self.pv_promote, Tk)


# Accumulators of the two products. fp8_fast is what the H200's fp8 tensor core measured
# (verify/accumulate.py, docs/diagnosis.md): each 32-wide step aligns its products and the running
# partial to the largest exponent among them and keeps 13 fraction bits below it, truncated.
ACCUMULATORS = ("fp32", "fp8_fast", "bf16", "fp16")
FP8_STEP = 32
FP8_FAST_BITS = 13
_ACC_U = {"fp32": U32, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


def accumulation_factor(acc: str, n: int, step: int = FP8_STEP) -> float:
    """g such that summing n terms t_k in accumulator `acc` errs by at most g * sum_k |t_k| (the
    running partial never exceeds that sum in magnitude, and a rescale by a factor <= 1 keeps it so).
    - fp32 / bf16 / fp16, one rounding per addition: gamma_n(u) (Higham's recursive summation).
    - fp8_fast: each of ceil(n / step) steps aligns <= step + 1 terms (products and the partial) to the
      exponent of the largest, |largest| <= sum_k |t_k|, and truncates each below 2^-13 of it: a step
      errs by < (step + 1) 2^-13 sum_k |t_k|, so g = ceil(n / step) (step + 1) 2^-13. It grows linearly
      with the keys summed before a promotion: at 16k keys never promoted it is ~2, no bound at all,
      which is the point: such a kernel cannot promise anything at long context."""
    if acc == "fp8_fast":
        return -(-n // step) * (step + 1) * 2.0 ** -FP8_FAST_BITS
    return _gamma(n, _ACC_U[acc])


def quantize_q_parts(q: torch.Tensor, fmt: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(code values fp32 [B, Hq, Tq, D], scale fp32 [B, Hq, Tq, 1]) of Q's per-(token, head)
    quantization, or (q in float32, None) when fmt is None. quantize_q is their product."""
    quantize_q(q, None)                                       # the shape / finiteness checks
    if fmt is None:
        return q.to(torch.float32), None
    qt = Q.quantize(q.reshape(-1, q.shape[-1]), QuantScheme(format=fmt, strategy="token", dynamic=True))
    return qt.decoded().reshape(q.shape), qt.scale.reshape(*q.shape[:-1], 1)


def quantize_q(q: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """Q_hat as float32 [B, Hq, Tq, D]: q's per-(token, head) codes times their scale (one float32
    rounding, as a kernel dequantizing in registers), or q itself in float32 when fmt is None."""
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or not q.is_floating_point():
        raise ValueError(f"q must be a float [batch, heads, tokens, head_dim] tensor, got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if not bool(torch.isfinite(q).all()):
        raise ValueError("q holds NaN/Inf; attention of non-finite queries is undefined: fix the activations")
    if fmt is None:
        return q.to(torch.float32)
    qt = Q.quantize(q.reshape(-1, q.shape[-1]), QuantScheme(format=fmt, strategy="token", dynamic=True))
    return qt.dequantize(torch.float32).reshape(q.shape)


def grid_round(v: torch.Tensor, p_format: str | None) -> torch.Tensor:
    """Round v >= 0 (float64) to P's grid: fp8 by lowbit.encode (RNE, saturating), int8 by
    round-half-even clamped to [0, 127]; identity for None."""
    if p_format is None:
        return v
    if p_format == "int8":
        return torch.round(v).clamp(0, 127)
    return decode(encode(v, p_format, saturate=True), p_format).to(torch.float64)


def allowed_mask(Tq: int, Tk: int, causal: bool, device=None) -> torch.Tensor:
    """[Tq, Tk] bool: which keys each query sees (bottom-right causal alignment)."""
    if not causal:
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if Tk < Tq:
        raise ValueError(f"causal attention with {Tq} queries but only {Tk} keys: the first {Tq - Tk} queries "
                         "would see no key; the cache must hold at least as many tokens as the queries")
    i = torch.arange(Tq, device=device)[:, None]
    j = torch.arange(Tk, device=device)[None, :]
    return j <= i + (Tk - Tq)


def check_shapes(q_shape, k_shape, v_shape) -> int:
    """Validate [B, Hq, Tq, D] / [B, Hkv, Tk, D] shapes; return the GQA group Hq // Hkv."""
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"q must be [B, Hq, Tq, D] and k, v the same [B, Hkv, Tk, D]; got q {tuple(q_shape)}, "
                         f"k {tuple(k_shape)}, v {tuple(v_shape)}")
    B, Hq, Tq, D = q_shape
    if k_shape[0] != B or k_shape[3] != D:
        raise ValueError(f"k/v batch and head_dim ({k_shape[0]}, {k_shape[3]}) differ from q's ({B}, {D})")
    Hkv = k_shape[1]
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, k/v {Hkv}: grouped-query attention needs Hq a multiple of Hkv")
    if Tq < 1 or k_shape[2] < 1:
        raise ValueError(f"q and k need at least one token (got Tq={Tq}, Tk={k_shape[2]})")
    return Hq // Hkv


def float64_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(q, k, v) in float64 on the CPU, k and v repeated to q's heads (grouped-query attention);
    the shapes checked by check_shapes. What the float64 references and bounds compute on."""
    G = check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape))
    return (q.detach().cpu().double(), k.detach().cpu().double().repeat_interleave(G, dim=1),
            v.detach().cpu().double().repeat_interleave(G, dim=1))


def _gamma(n: int, u: float) -> float:
    nu = n * u
    return math.inf if nu >= 1 else nu / (1 - nu)


@dataclass
class AttnReference:
    """out: float64 [B, Hq, Tq, D]; gate: float64 absolute tolerance per element for a correct
    kernel (or a kernel with exactly the simulated bug); P statistics for reports."""

    out: torch.Tensor
    gate: torch.Tensor
    p_zero_fraction: float      # allowed P entries whose code is 0 (the softmax tail lost)
    p: torch.Tensor | None = None   # with return_p: the normalized weights [B, Hq, Tq, Tk] O is made of


def _narrow_pv(acc, lo, done, wt, Vb, stretch, pv_accumulate):
    """One key block's P.V added through a narrow accumulator: lo (the narrow partial) takes the
    products through pv_accumulate(lo, w [.., Tq, n], V [.., n, D]) -> lo, and is added into the
    fp32 O (acc) and restarted every `stretch` keys (done: keys in lo so far). Returns (acc, lo, done)."""
    a, n = 0, wt.shape[-1]
    while a < n:
        take = min(n - a, stretch - done)
        lo = pv_accumulate(lo, wt[..., a:a + take], Vb[:, :, a:a + take])
        a, done = a + take, done + take
        if done == stretch:
            acc, lo, done = acc + lo, torch.zeros_like(lo), 0
    return acc, lo, done


def attention_reference(q_hat: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, spec: AttnSpec, *,
                        variant: str | None = None, out_dtype: torch.dtype = torch.float32,
                        return_p: bool = False, pv_accumulate=None) -> AttnReference:
    """The quantization-aware reference (module docstring) of already dequantized operands
    q_hat [B, Hq, Tq, D], k_hat / v_hat [B, Hkv, Tk, D] (float32 values; used exactly in float64).

    Gate (per output element, derived; no tuned constant):
    1. Scores: t is an fp32 dot of D exact-valued products (D - 1 roundings), plus the scale-constant
       rounding and, in the worst order (the tensor-core kernels: code dots with q_scale, k_scale and
       the constant multiplied after), three multiplies and the two dequantizing roundings the
       kernel never makes but Q_hat / K_hat carry: |t' - t| <= e_ij = gamma_{D+5}(2^-24) *
       sum_d |Q_hat||K_hat| * sm_scale * log2(e). The block max moves by at most E_b = max_j e_ij (max is 1-Lipschitz).
    2. Codes: the kernel rounds fp32 v' = fmt_max * 2^(t' - mb') with |log2(v'/v)| <= delta =
       e_ij + E + 2^-24 |t - mb| + EXP2_ERR (+ the product's rounding); where [v 2^-delta, v 2^delta]
       holds no rounding boundary the code is the reference's, elsewhere it may move to any grid
       point in that interval: dc_ij = max |grid(end) - c_ij| (0 for almost every element).
    3. Weights: each block's factor 2^(mb - m) and the later rescales are computed with at most
       2 nb + 4 exp2 / multiplies, and m's error cancels between O and l (both get the same
       fp32 factors), so w'_j = K w_j 2^(+-zeta_b) for one common K, zeta_b = E + (2 nb + 4)
       EXP2_ERR + 2^-24 (|M - mb| + |M - mb_0|); with eta_b = 2^zeta_b - 1,
       D_j = w_j eta_b + dc_j (1 + eta_b) 2^(mb - M) / fmt_max.
    4. O/l with perturbed weights: |O' - O| <= sum_j D_j |V_j - O| / (L - sum_j D_j) (the
       perturbation of a weighted mean), then the fp32 accumulation of p_block products, 2 nb
       rescale operations and the division, gamma_n(2^-24) with n = p_block + 2 nb + 8, applied
       to (sum (w + D)|V| + |O| (L + sum D)) / (L - sum D), the output rounding u_out (|O| +
       that) + eta_out / 2, and exp2's flush of arguments below -126 (2^-120 Tk max|V| / L).
    5. The accumulators the spec declares: a narrow Q.K^T sum adds accumulation_factor(qk_acc, D)
       sum_d |Q_hat||K_hat| to e (step 1); a narrow P.V sum adds accumulation_factor(pv_acc, S)
       sum (w + D)|V| / (L - sum D), S = the keys summed before each fp32 promotion (spec.pv_stretch:
       the whole context Tk when never promoted), since each stretch errs by that factor times its
       own share of sum w|V| and the stretches partition the keys. With fp8_fast and no promotion
       the term grows linearly with the context (Tk 2^-13 33 / 32); promoted every S keys it does
       not grow with the context at all, only the fp32 roundings of step 4 do (2 nb of them).
    The low-precision-O variants add 2 u_low nb sum (w + D)|V| / (L - sum D): one rounding of O
    per block that the bugged kernel may resolve to the other neighbour. The skipped-rescale
    variants take their own weights (relative to the running max, where the rescale is missing),
    add twice the running max's error to zeta, and rescale_wrong_acc, whose O is no weighted mean,
    bounds the deviation by sum_j Da_j |V_j| + |O| sum_j Dd_j instead of sum_j D_j |V_j - O|.
    pv_accumulate: simulate the spec's narrow P.V accumulator instead of summing exactly (a kernel
    with that accumulator, for the diagnosis): (partial, w [.., Tq, n], V [.., n, D]) -> partial,
    the partial added into O every spec.pv_stretch(Tk) keys.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    qd, kd, vd = float64_heads(q_hat, k_hat, v_hat)
    B, Hq, Tq, D = q_hat.shape
    Tk = k_hat.shape[2]
    c = spec.scale_for(D) * LOG2E
    T = (qd @ kd.transpose(-1, -2)) * c                      # [B, Hq, Tq, Tk], log2 units
    g_qk = 0.0 if spec.qk_acc == "fp32" else accumulation_factor(spec.qk_acc, D)
    e = (_gamma(D + 5, U32) + g_qk) * (qd.abs() @ kd.abs().transpose(-1, -2)) * c
    allowed = allowed_mask(Tq, Tk, spec.causal).expand_as(T)
    ninf = torch.tensor(-math.inf, dtype=torch.float64)
    fmax = spec.p_max
    BN = spec.p_block
    nb = -(-Tk // BN)
    max_mask = torch.ones_like(allowed) if variant == "causal_after_p" else allowed
    Tm = torch.where(max_mask, T, ninf)
    em = torch.where(max_mask, e, torch.zeros_like(e))
    mbs, ebs = [], []
    for b in range(nb):
        sl = slice(b * BN, min((b + 1) * BN, Tk))
        mbs.append(Tm[..., sl].amax(dim=-1, keepdim=True))
        ebs.append(em[..., sl].amax(dim=-1, keepdim=True))
    Mb = torch.cat(mbs, dim=-1)                               # [B, Hq, Tq, nb]
    M = Mb.amax(dim=-1, keepdim=True)                         # final row max (finite: key 0 is seen)
    m_run = torch.cummax(Mb, dim=-1).values
    E_run = torch.cummax(torch.cat(ebs, dim=-1), dim=-1).values

    acc = torch.zeros(B, Hq, Tq, D, dtype=torch.float64)
    l = torch.zeros(B, Hq, Tq, 1, dtype=torch.float64)
    m_prev = torch.full((B, Hq, Tq, 1), -math.inf, dtype=torch.float64)
    sum_w = torch.zeros_like(l)
    sum_D = torch.zeros_like(l)
    dev_num = torch.zeros_like(acc)       # sum_j D_j |V_j - O| (O filled in after the loop)
    wabs_v = torch.zeros_like(acc)        # sum_j (w_j + D_j) |V_j|
    zero_codes, n_allowed = 0, 0
    # weights relative to M are kept per block for the deviation term, which needs the final O
    blocks = []
    part, done, stretch = torch.zeros_like(acc), 0, spec.pv_stretch(Tk)   # the narrow P.V partial
    for b in range(nb):
        sl = slice(b * BN, min((b + 1) * BN, Tk))
        Tb, Ab, Vb = T[..., sl], allowed[..., sl], vd[:, :, sl]
        mb, mnew = Mb[..., b:b + 1], m_run[..., b:b + 1]
        ref_max = mnew if variant == "p_per_tensor" else mb
        ok_row = torch.isfinite(ref_max)
        ref0 = torch.where(ok_row, ref_max, torch.zeros_like(ref_max))
        code_mask = torch.ones_like(Ab) if variant == "causal_after_p" else Ab
        x = torch.where(code_mask & ok_row, torch.exp2(Tb - ref0), torch.zeros_like(Tb))
        v = x * fmax
        codes = grid_round(v, spec.p_format)
        # 2. code ambiguity interval
        Eb = E_run[..., b:b + 1]
        delta = e[..., sl] + Eb + U32 * (Tb - ref0).abs() + EXP2_ERR
        lo = grid_round(v * torch.exp2(-delta) * (1 - 2 * U32), spec.p_format)
        hi = grid_round(v * torch.exp2(delta) * (1 + 2 * U32), spec.p_format)
        dc = torch.maximum((hi - codes).abs(), (codes - lo).abs())
        if variant == "causal_after_p":
            codes, dc = codes * Ab, dc * Ab
        dc = torch.where(code_mask, dc, torch.zeros_like(dc))
        zero_codes += int(((codes == 0) & Ab).sum())
        n_allowed += int(Ab.sum())
        # weights of this block relative to its running max (what the kernel adds), and to M
        fac_run = torch.where(ok_row, torch.exp2(ref0 - torch.where(torch.isfinite(mnew), mnew, ref0)),
                              torch.zeros_like(ref0))
        wt = codes / fmax * fac_run                                    # relative to m_new
        alpha = torch.where(torch.isfinite(m_prev), torch.exp2(m_prev - mnew), torch.zeros_like(m_prev))
        a_o = torch.ones_like(alpha) if variant in ("rescale_skipped", "rescale_wrong_acc") else alpha
        a_l = torch.ones_like(alpha) if variant == "rescale_skipped" else alpha
        if pv_accumulate is None:
            acc = acc * a_o + wt @ Vb
        else:
            acc, part, done = _narrow_pv(acc * a_o, part * a_o, done, wt, Vb, stretch, pv_accumulate)
        if variant in _LOW:
            acc = acc.to(torch.float32).to(_LOW[variant][0]).to(torch.float64)
        l = l * a_l + wt.sum(dim=-1, keepdim=True)
        m_prev = torch.where(torch.isfinite(mnew), mnew, m_prev)
        # 3. gate pieces: the weights O's numerator and l are made of, relative to the final max M
        #    (a skipped rescale leaves them relative to the running max at their block instead)
        ref_fin = torch.where(torch.isfinite(ref_max), ref_max, M)
        run_max = torch.where(torch.isfinite(mnew), mnew, M)
        num_rel = torch.exp2(ref_fin - (run_max if variant in _NO_RESCALE_O else M))
        den_rel = torch.exp2(ref_fin - (run_max if variant == "rescale_skipped" else M))
        # with the rescale skipped, the running max's error no longer cancels between O and l
        extra = 2 * E_run[..., -1:] if variant in _NO_RESCALE_O else 0.0
        zeta = Eb + extra + (2 * nb + 4) * EXP2_ERR + U32 * ((M - ref0).abs() + (M - Mb[..., :1]).abs())
        eta = torch.exp2(zeta) - 1
        a_w, d_w = codes / fmax * num_rel, codes / fmax * den_rel
        Da = a_w * eta + dc * (1 + eta) * num_rel / fmax
        Dd = d_w * eta + dc * (1 + eta) * den_rel / fmax
        sum_w += d_w.sum(dim=-1, keepdim=True)
        sum_D += Dd.sum(dim=-1, keepdim=True)
        wabs_v += (a_w + Da) @ Vb.abs()
        if variant == "rescale_wrong_acc":           # numerator and l weigh differently: no weighted mean
            dev_num += Da @ Vb.abs()
        blocks.append((Dd, Vb, d_w if return_p else None))
    out = (acc + part) / l
    if variant == "rescale_wrong_acc":
        dev_num += out.abs() * sum_D
    else:
        for Dj, Vb, _ in blocks:
            # sum_j D_j |V_jd - O_d| without a [.., Tq, Tk, D] intermediate: split |V - O| per key block
            dev_num += torch.einsum("bhqk,bhqkd->bhqd", Dj, (Vb.unsqueeze(2) - out.unsqueeze(3)).abs())
    den = sum_w - sum_D
    inf = torch.tensor(math.inf, dtype=torch.float64)
    safe = den > 0
    den_s = torch.where(safe, den, torch.ones_like(den))
    n_acc = BN + 2 * nb + 8
    wv = wabs_v / den_s
    kern = dev_num / den_s + _gamma(n_acc, U32) * (wv + out.abs() * (sum_w + sum_D) / den_s)
    if variant in _LOW:
        kern = kern + 2 * _LOW[variant][1] * nb * wv
    if spec.pv_acc != "fp32":
        kern = kern + accumulation_factor(spec.pv_acc, spec.pv_stretch(Tk)) * wv
    kern = kern + 2.0 ** -120 * Tk * vd.abs().amax(dim=2, keepdim=True) / den_s + 4 * U64 * wv
    u_out, eta_out = _OUT_UNITS[out_dtype]
    gate = kern + u_out * (out.abs() + kern) + eta_out / 2
    gate = torch.where(safe, gate, inf)
    p = torch.cat([w for *_, w in blocks], dim=-1) / sum_w if return_p else None
    return AttnReference(out, gate, zero_codes / max(n_allowed, 1), p)


def sdpa_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 sm_scale: float | None = None) -> torch.Tensor:
    """Unquantized float64 attention of the ORIGINAL inputs (the quantization error's yardstick)."""
    G = check_shapes(q.shape, k.shape, v.shape)
    D = q.shape[-1]
    s = (1.0 / math.sqrt(D)) if sm_scale is None else sm_scale
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    S = (qd @ kd.transpose(-1, -2)) * s
    S = torch.where(allowed_mask(q.shape[2], k.shape[2], causal), S, torch.tensor(-math.inf, dtype=torch.float64))
    return torch.softmax(S, dim=-1) @ vd


def sdpa_bf16_reference(q: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, causal: bool,
                        sm_scale: float | None = None, out_dtype: torch.dtype = torch.bfloat16) -> AttnReference:
    """Float64 reference and derived gate of lowbit.ops.attention_sdpa (bf16 SDPA over the
    dequantized cache): q [B, Hq, Tq, D] and the cache's fp32 values k_hat / v_hat [B, Hkv, Tk, D]
    are each rounded to bf16 once (what the kernel reads), then exact softmax attention.

    Gate, for any flash-style bf16 kernel (cuDNN, flash, memory-efficient; fp32 scores, P rounded
    to bf16 for the P.V dot, fp32 accumulation; not one that rounds the scores to bf16):
    1. Scores s_ij = q.k * sm_scale: D exact bf16 products summed in fp32 plus the scale and the
       log2(e) folding: |s' - s| <= e_ij = gamma_{D+4}(2^-24) sum_d |q_d k_d| sm_scale. The row max
       the kernel subtracts is common to O and l and cancels; the exponent's argument s - m carries
       at most 4 fp32 roundings of |s| + |m| and exp2's error EXP2_ERR (log2 units).
    2. Each weight reaches O as w_j (1 + a_j) and l as w_j (1 + b_j) with |a_j|, |b_j| <= eta_j =
       2^(delta_j) (1 + 2^-8) - 1, delta_j = (e_ij + 4 u32 (|s_ij| + max_j |s_ij|)) log2(e) + EXP2_ERR
       + nr (EXP2_ERR + 8 u32 max_j |s_ij| log2(e)): its own exp2 and the nr = ceil(Tk / 16) online
       rescales after its block (each common to O and l, but not to the other blocks' weights)
       (2^-8: P rounded to bf16 for the dot; applied to both, whichever the kernel normalizes by), so
       |O/l - out| <= sum_j p_j eta_j (|v_j| + |out|) / (1 - max eta) (p the exact weights).
    3. fp32 accumulation of Tk products and the online rescales (at most 2 per 16-key block) and the
       division: gamma_n(2^-24), n = Tk + 2 ceil(Tk / 16) + 8, of sum_j p_j |v_j| (1 + eta) / (1 - eta);
       exp2's flush below 2^-126: 2^-120 Tk max|v|; the output rounding u_out (|out| + kern) + eta_out / 2.
    """
    def bf16(t):
        return t.detach().cpu().to(torch.float32).to(torch.bfloat16).to(torch.float32)
    qd, kd, vd = float64_heads(bf16(q), bf16(k_hat), bf16(v_hat))
    Tq, D = q.shape[2], q.shape[3]
    Tk = k_hat.shape[2]
    s = (1.0 / math.sqrt(D)) if sm_scale is None else float(sm_scale)
    S = (qd @ kd.transpose(-1, -2)) * s
    e = _gamma(D + 4, U32) * (qd.abs() @ kd.abs().transpose(-1, -2)) * s
    allowed = allowed_mask(Tq, Tk, causal).expand_as(S)
    Sm = torch.where(allowed, S, torch.tensor(-math.inf, dtype=torch.float64))
    p = torch.softmax(Sm, dim=-1)
    out = p @ vd
    smax = torch.where(allowed, S.abs(), torch.zeros_like(S)).amax(dim=-1, keepdim=True)
    nr = -(-Tk // 16)                       # online rescales: at most one per key block of >= 16 keys
    delta = (e + 4 * U32 * (S.abs() + smax)) * LOG2E + EXP2_ERR + nr * (EXP2_ERR + 8 * U32 * smax * LOG2E)
    eta = torch.where(allowed, torch.exp2(delta) * (1 + 2.0 ** -8) - 1, torch.zeros_like(S))
    eta_max = eta.amax(dim=-1, keepdim=True)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    safe = eta_max < 1
    den = torch.where(safe, 1 - eta_max, torch.ones_like(eta_max))
    pv_abs = p @ vd.abs()
    dev = ((p * eta) @ vd.abs() + out.abs() * (p * eta).sum(dim=-1, keepdim=True)) / den
    n_acc = Tk + 2 * (-(-Tk // 16)) + 8
    kern = dev + _gamma(n_acc, U32) * pv_abs * (1 + eta_max) / den
    kern = kern + 2.0 ** -120 * Tk * vd.abs().amax(dim=2, keepdim=True)
    u_out, eta_out = _OUT_UNITS[out_dtype]
    gate = kern + u_out * (out.abs() + kern) + eta_out / 2
    return AttnReference(out, torch.where(safe, gate, inf), 0.0)
