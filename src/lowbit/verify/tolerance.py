"""Tolerances derived from the format, the scale policy, K and the accumulator: never tuned.

Two gates, for two different questions (choose the reference first):

1. implementation_gate: kernel output vs the quantization-aware float64 reference
   (lowbit.ops.reference.qlinear_reference). Both sides use the same codes and scales, so the
   only legitimate difference is the kernel's own rounding: none inside an int32 accumulator,
   Higham's gamma_n(u) = n*u / (1 - n*u) times sum_k |x_q||w_q| for a float accumulator.
2. quantization_gate: kernel output vs x @ w.T of the ORIGINAL float inputs in float64 (a
   reference rebuilt from the quantized values would forgive the quantization error). Its
   deterministic part adds the worst-case quantization error of every term (scales with K);
   its statistical part (sqrt(K)) only warns.

All gates are float64 [M, N] absolute tolerances, one per output element, because output
columns are not comparable (one tolerance from the matrix maximum is 64x too loose on the
quietest column of a matrix whose column gains span 64x).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import lowbit as lb
from lowbit.ops.reference import as_operand, expand_rows, sum_abs_products
from lowbit.quantize import reduce_amax

# Unit roundoff of the accumulators a kernel may promise; 0 = exact (integer).
# fp8_fast: Hopper's fp8 tensor-core accumulator (verify/accumulate.py, measured on the H200): each
# 32-wide MMA step truncates its 32 products and the running sum to 13 fraction bits below the
# largest of them, an error < 33 * 2^-13 * T_k per step (T_k = sum of |products| so far), so
# < (33/32) * K * 2^-13 * T over K. The gate's gamma_{K+4}(2^-13) * T covers it at every K:
# (K + 4) / (1 - (K + 4) 2^-13) >= K + 4 + (K + 4)^2 2^-13 >= (33/32) K, as 4 + (K+4)^2/8192 >= K/32.
ACCUMULATORS = {"int32": 0.0, "fp32": 2.0 ** -24, "fp8_fast": 2.0 ** -13, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
U32 = 2.0 ** -24          # epilogue arithmetic (scale multiplies, bias add) is float32
U64 = 2.0 ** -53          # the float64 reference's own rounding
TABLE_SLACK = 4.0         # the matmul table's slack on its gate (summation order + second-order term)

_OUT_DTYPES = {torch.float32: (2.0 ** -24, 2.0 ** -149), torch.float16: (2.0 ** -11, 2.0 ** -24),
               torch.bfloat16: (2.0 ** -8, 2.0 ** -133), torch.float64: (U64, 2.0 ** -1074)}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative error bound of n successive roundings
    with unit roundoff u (inf once n*u >= 1, where the bound says nothing)."""
    if n < 0 or u < 0:
        raise ValueError(f"gamma needs n >= 0 and u >= 0, got n={n}, u={u}")
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def out_dtype_units(dtype: torch.dtype) -> tuple[float, float]:
    """(unit roundoff, smallest subnormal) of the kernel's output dtype."""
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"output dtype {dtype} is not a float dtype lowbit can gate; use one of "
                         f"{', '.join(str(d) for d in _OUT_DTYPES)}")
    return _OUT_DTYPES[dtype]


def _is_int(q) -> bool:
    return hasattr(q, "scheme") and q.scheme.fmt.kind == "int"


def default_accumulator(xq, wq) -> str:
    """int32 when both sides hold integer codes (the integer dot product is exact), else fp32."""
    return "int32" if (_is_int(xq) and _is_int(wq)) else "fp32"


def rounding_count(xq, wq, accumulator: str, bias: bool) -> tuple[int, float]:
    """(n, u) such that gamma_n(u) * sum_k |x_q||w_q| bounds a correct kernel's rounding error.

    A kernel's result for one output is a tree of operations; every path from a product to the
    output passes through at most n roundings:
    - int32 accumulator: the K-block integer sums are exact (|acc| <= K*qmax_x*qmax_w < 2^31 is the
      kernel's promise); then float conversion, x-scale and w-scale multiplies (3) and, with
      several K-blocks, nb - 1 float32 additions; + 1 for a bias. All float32: u = 2^-24.
    - float accumulator: within a K-block of gc elements, gc roundings (one per product that is
      not exact, one per addition); products of two <= 8-bit float elements are exact in
      fp32 (at most 4 x 4 significant bits), but counting them keeps the bound simple and safe;
      then the block's 2 scale multiplies, nb additions across blocks, 1 conversion of an
      unquantized side; + 1 for a bias. u = max(u_acc, 2^-24).
    """
    if accumulator not in ACCUMULATORS:
        raise ValueError(f"accumulator must be one of {list(ACCUMULATORS)}, got {accumulator!r}")
    x, w = as_operand(xq, "xq"), as_operand(wq, "wq")
    K = x.vals.shape[1]
    gc = math.gcd(x.group, w.group)
    nb = K // gc
    if accumulator == "int32":
        if not (x.exact and w.exact and _is_int(xq) and _is_int(wq)):
            raise ValueError("accumulator='int32' needs integer codes on both sides; for float "
                             "element formats or an unquantized side pass 'fp32' (or what the kernel uses)")
        return 3 + (nb - 1) + int(bias), U32
    return gc + 2 + nb + 1 + int(bias), max(ACCUMULATORS[accumulator], U32)


def implementation_gate(xq, wq, ref: torch.Tensor, *, accumulator: str | None = None,
                        out_dtype: torch.dtype = torch.float32, bias=None) -> torch.Tensor:
    """Per-element absolute tolerance [M, N] for |out - ref| where ref = qlinear_reference(xq, wq, bias).

    gate = gamma_n(u) * T + u_out * (|ref| + gamma_n(u) * T) + eta_out / 2 + 4 * 2^-53 * T,
    with T = sum_k |x_q||w_q|: the kernel's own roundings (see rounding_count), then the one
    rounding to the output dtype (relative u_out of the pre-cast value, whose size is at most
    |ref| + the first term; eta_out, the smallest subnormal, covers underflow), plus the float64
    reference's own few roundings. No slack factor: each term is a worst case.
    """
    acc = accumulator or default_accumulator(xq, wq)
    ref = ref.detach().to("cpu", torch.float64)
    n, u = rounding_count(xq, wq, acc, bias is not None)
    T = sum_abs_products(xq, wq).reshape(ref.shape)
    if bias is not None:
        T = T + torch.as_tensor(bias).detach().to("cpu", torch.float64).abs()
    return gate_from_sum(T, ref, n, u, out_dtype)


def gate_from_sum(T: torch.Tensor, ref: torch.Tensor, n: int, u: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The implementation gate's formula for T = sum_k |x_q||w_q| (+ |bias|) [M, N], the exact
    result `ref` [M, N] and a kernel making at most n roundings of unit roundoff u per output
    (see implementation_gate). Also used for the output of a simulated bug."""
    u_out, eta_out = out_dtype_units(out_dtype)
    kern = gamma(n, u) * T
    return kern + u_out * (ref.abs() + kern) + eta_out / 2 + 4 * U64 * T


# ------------------------------------------------------------------------------------------
# Quantization gate (vs the original float inputs)
# ------------------------------------------------------------------------------------------
@dataclass
class SideBound:
    """Per-(row, K-group) statistics of one operand.

    amax: float64 [R, G], max |value| in the group (the "max|x|" of the per-column bound).
    err:  float64 [R, G], bound on |x - dequant(x)| for every element of the group.
    group: K elements per group.
    """

    amax: torch.Tensor
    err: torch.Tensor
    group: int


def element_error_bound(x, qt) -> SideBound:
    """Worst-case |x - dequantize(quantize(x))| per scale group, derived from the scheme.

    x: original float tensor [R, K]; qt: its QTensor (None = unquantized: zero error).
    - int, symmetric: round-to-nearest on a grid of step s gives s/2; x / s is an IEEE float32
      division, off by at most 2u32 * amax in units of x, which can move a value across a
      rounding boundary (+ 2u32*amax); a scale below amax/qmax (any rule other than lowbit's)
      clips the largest values by up to amax - qmax*s.
    - int, asymmetric: s/2 as well (the zero point is rounded, but the clamp at either end
      never costs more than half a step: qmin - z <= min/s + 1/2 and qmax - z >= max/s - 1/2).
    - float elements: RNE error <= u_fmt * |v| on the normal range and <= min_subnormal/2 below
      it (v = x/s, u_fmt = 2^-(mbits+1)); in units of x: u_fmt * amax + s * min_subnormal / 2,
      plus clipping amax - fmt.max * s where the scale rule lets amax/s exceed fmt.max (MX
      "floor" rounding: up to 512/448 for e4m3), plus the float32 division as above.
    """
    xf = torch.as_tensor(x).detach().cpu()
    if xf.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, K] for a gate, got shape {tuple(xf.shape)}")
    if qt is None:
        amax = xf.to(torch.float64).abs().amax(dim=1, keepdim=True)
        return SideBound(amax, torch.zeros_like(amax), xf.shape[1])
    if tuple(qt.codes.shape) != tuple(xf.shape):
        raise ValueError(f"QTensor codes have shape {tuple(qt.codes.shape)} but x has {tuple(xf.shape)}; "
                         f"quantize x without padding (K a multiple of the group size)")
    R, K = xf.shape
    amax = expand_rows(reduce_amax(xf.float(), qt.scheme).to(torch.float64), R, qt.scheme, "amax")
    s = expand_rows(qt.scale.detach().cpu().to(torch.float64), R, qt.scheme, "scale")
    fmt = qt.scheme.fmt
    div = 2 * U32 * amax
    if fmt.kind == "int":
        clip = (amax - fmt.qmax * s).clamp(min=0) if qt.zero_point is None else torch.zeros_like(s)
        err = s / 2 + clip + div
    else:
        clip = (amax - float(fmt.max) * s).clamp(min=0)
        err = float(fmt.unit_roundoff) * amax + s * float(fmt.min_subnormal) / 2 + clip + div
    return SideBound(amax, err, K // s.shape[1])


def _to_blocks(b: SideBound, gc: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = b.group // gc
    return b.amax.repeat_interleave(rep, dim=1), b.err.repeat_interleave(rep, dim=1)


def quantization_bounds(x, w, xq=None, wq=None, *, slack: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(deterministic, statistical) bounds [M, N] on |x_q @ w_q.T - x @ w.T|.

    Write x = x_q + e_x, w = w_q + e_w (per element |e_x| <= E_x of its group, |x| <= X of its
    group, likewise E_w, W). Then x.w - x_q.w_q = e_x.w + x.e_w - e_x.e_w, so
      deterministic:  sum_k E_x W + X E_w + E_x E_w     (no cancellation assumed: scales with K;
                      for int8 one-scale x and per-column w: K*amax*wcolmax/127 + O(1/127^2),
                      the per-column gate before its slack of 4)
      statistical:    4 * sqrt(2 * sum_k (E_x W)^2 + (X E_w)^2)   (independent zero-mean errors
                      add in quadrature; sqrt(2(a^2+b^2)) >= a+b, equal when a=b, which gives
                      4*sqrt(K)*amax*wcolmax/127 exactly; it warns, it never gates)
    Both multiplied by `slack` (1 for a rigorous gate, TABLE_SLACK for `lowbit experiment matmul`'s table).
    The sums run over K-blocks where both sides' groups are constant, so they cost an
    [M, nb] @ [nb, N] product, not a K-long one.
    """
    bx, bw = element_error_bound(x, xq), element_error_bound(w, wq)
    if torch.as_tensor(x).shape[1] != torch.as_tensor(w).shape[1]:
        raise ValueError("x and w must share K (w is [N, K], out = x @ w.T)")
    gc = math.gcd(bx.group, bw.group)
    X, Ex = _to_blocks(bx, gc)
    W, Ew = _to_blocks(bw, gc)
    det = gc * (Ex @ W.T + X @ Ew.T + Ex @ Ew.T)
    stat = 4.0 * torch.sqrt(2.0 * gc * ((Ex * Ex) @ (W * W).T + (X * X) @ (Ew * Ew).T))
    return slack * det, slack * stat


def reference_gate(x, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed yardstick for one matmul: the gates an int8 kernel with one scale for x
    and one scale per column of w must meet, (4*K*max|x|*max|w[c,:]|/127, the same with
    sqrt(K)), [M, N]. Every row of `lowbit experiment matmul` is measured against it."""
    xt, wt = torch.as_tensor(x).float(), torch.as_tensor(w).float()
    xs = lb.QuantScheme(format="int8", strategy="tensor")
    ws = lb.QuantScheme(format="int8", strategy="channel")
    return quantization_bounds(xt, wt, lb.quantize(xt, xs), lb.quantize(wt, ws), slack=TABLE_SLACK)
