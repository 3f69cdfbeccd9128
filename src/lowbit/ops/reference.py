"""Float64 quantization-aware reference for quantized linear layers.

`qlinear_reference(xq, wq, bias)` returns x_q @ w_q.T (+ bias) in float64, where x_q and w_q
are exactly what the QTensors' codes, scales and zero points say. The integer part of every
dot product is accumulated EXACTLY, the scales are applied afterwards, per K-block where they
change along K (per-group, MX, block scales).

Why float64 BLAS can be exact: every code is turned into an integer-valued float64 (integer
formats: the code minus its zero point; float formats: the decoded value divided by the format's
smallest subnormal, a power of two, so the division is exact and the quotient an integer). A sum
of integer products whose partial sums all stay below 2^53 in magnitude is computed without a
single rounding, in any order, FMA or not. With |codes| <= bx, bw that holds while
K * bx * bw < 2^53 (int8: K < 5.6e11; fp8 e4m3: values are multiples of 2^-9 up to 448, so
integers up to 229376 and K < 1.7e5). Beyond that K is cut into chunks that each satisfy it and
the chunk results are summed in int64 (exact while the total stays below 2^63).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.formats import decode

_EXACT = 2.0 ** 53          # float64 holds every integer below this
_INT64 = 2.0 ** 63


def _is_qtensor(t) -> bool:
    return hasattr(t, "codes") and hasattr(t, "scale") and hasattr(t, "scheme")


@dataclass
class Operand:
    """One side of a matmul, flattened to 2-D.

    vals:   float64 [R, K]; integer-valued when `exact` (codes - zero point, or decoded float
            codes in units of the format's smallest subnormal).
    scale:  float64 [R, G]; what multiplies `vals` in K-group g (includes the subnormal unit).
    group:  K // G, the number of consecutive K elements sharing one scale.
    bound:  max |vals| (for the exactness test).
    exact:  True when vals are integers (a quantized side).
    lead:   the leading shape of the original tensor (everything but K).
    """

    vals: torch.Tensor
    scale: torch.Tensor
    group: int
    bound: float
    exact: bool
    lead: tuple

    def dequantized(self) -> torch.Tensor:
        """Float64 [R, K] values this operand stands for (exact for <= 8-bit codes times a
        float32 scale: at most 18 + 24 significant bits)."""
        return self.vals * self.scale.repeat_interleave(self.group, dim=1)


def expand_rows(t: torch.Tensor, R: int, scheme, name: str) -> torch.Tensor:
    """[Rs, G] per-scale-row tensor -> [R, G] per-row (tensor: Rs=1; channel/group: Rs=R;
    block (br, bc): Rs=ceil(R/br))."""
    Rs = t.shape[0]
    if Rs == R:
        return t
    if Rs == 1:
        return t.expand(R, t.shape[1])
    block = getattr(scheme, "block_size", None)
    if block is not None and Rs == -(-R // block[0]):
        return t.repeat_interleave(block[0], dim=0)[:R]
    raise ValueError(f"{name}.scale has {Rs} rows for {R} rows of codes; expected 1, {R} or "
                     f"ceil(rows / block rows): the QTensor is inconsistent, re-quantize it")


def as_operand(t, name: str = "x") -> Operand:
    """Turn a QTensor (or a plain tensor / numpy array, meaning "not quantized") into an Operand."""
    if not _is_qtensor(t):
        v = torch.as_tensor(t)
        if not (v.is_floating_point() or v.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32,
                                                     torch.int64)):
            raise TypeError(f"{name} must be a QTensor or a real tensor, got dtype {v.dtype}")
        if v.ndim < 1:
            raise ValueError(f"{name} must have a last (K) axis, got a scalar")
        v = v.detach().to("cpu", torch.float64)
        if not torch.isfinite(v).all():
            raise ValueError(f"{name} contains NaN or Inf; the reference needs finite inputs")
        lead = tuple(v.shape[:-1])
        v = v.reshape(-1, v.shape[-1])
        return Operand(v, torch.ones(v.shape[0], 1, dtype=torch.float64), v.shape[1],
                       float(v.abs().max().item()) if v.numel() else 0.0, False, lead)

    fmt = t.scheme.fmt
    codes = t.codes.detach().cpu()
    if codes.ndim < 1:
        raise ValueError(f"{name}.codes must have a last (K) axis")
    lead, K = tuple(codes.shape[:-1]), codes.shape[-1]
    codes = codes.reshape(-1, K)
    R = codes.shape[0]
    scale = t.scale.detach().cpu().to(torch.float64)
    if scale.ndim != len(lead) + 1:
        raise ValueError(f"{name}.scale has ndim {scale.ndim}, codes ndim {len(lead) + 1}: they must match")
    G = scale.shape[-1]
    if G < 1 or K % G:
        raise ValueError(f"{name}.scale has {G} groups along K={K}; K must be a multiple of it")
    group = K // G
    if scale.ndim > 2:  # leading dims: tensor scales broadcast, token scales match
        scale = scale.expand(*lead, G).reshape(-1, G)
    scale = expand_rows(scale, R, t.scheme, name)
    if not torch.isfinite(scale).all():
        raise ValueError(f"{name}.scale contains NaN or Inf")

    if fmt.kind == "int":
        vals = codes.to(torch.float64)
        if t.zero_point is not None:
            zp = t.zero_point.detach().cpu().to(torch.float64)
            if zp.ndim > 2:
                zp = zp.expand(*lead, G).reshape(-1, G)
            zp = expand_rows(zp, R, t.scheme, name + ".zero_point")
            vals = vals - zp.repeat_interleave(group, dim=1)
    else:
        dec = decode(codes, fmt).to(torch.float64)
        if not torch.isfinite(dec).all():
            raise ValueError(f"{name}.codes hold NaN/Inf bit patterns for {fmt.name}; the "
                             f"quantizer must never produce them (check the scale)")
        unit = float(fmt.min_subnormal)  # a power of two: division and multiplication are exact
        vals = dec / unit
        scale = scale * unit
    bound = float(vals.abs().max().item()) if vals.numel() else 0.0
    return Operand(vals, scale.contiguous(), group, bound, True, lead)


def exact_int_matmul(a: torch.Tensor, b: torch.Tensor, ba: float, bb: float) -> torch.Tensor:
    """a @ b.T for integer-valued float64 a [M, K], b [N, K] with |a| <= ba, |b| <= bb, exactly
    (or, where the exact result would overflow int64, rounded once per chunk in float64)."""
    K = a.shape[1]
    if K == 0 or ba == 0 or bb == 0:
        return torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64)
    if ba * bb >= _EXACT:
        # Even one product may not fit 53 bits (e.g. e5m2 x e5m2): split the wider side
        # a = hi * 2^s + lo with integer hi, lo, both exact, and combine.
        if ba < bb:
            return exact_int_matmul(b, a, bb, ba).T
        s = 2.0 ** math.ceil(math.log2(ba) / 2)
        hi = torch.floor(a / s)
        lo = a - hi * s
        return exact_int_matmul(hi, b, math.ceil(ba / s), bb) * s + exact_int_matmul(lo, b, s, bb)
    if K * ba * bb < _EXACT:
        return a @ b.T
    chunk = int(_EXACT // (ba * bb))
    use_int64 = K * ba * bb < _INT64
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int64 if use_int64 else torch.float64)
    for k0 in range(0, K, chunk):
        part = a[:, k0:k0 + chunk] @ b[:, k0:k0 + chunk].T  # exact integers
        acc += part.to(acc.dtype)
    return acc.to(torch.float64)


def qlinear_reference(xq, wq, bias=None) -> torch.Tensor:
    """Float64 x_q @ w_q.T (+ bias), shape [..., N] for x [..., K] and w [N, K].

    xq, wq: QTensor (quantized side, exact integer accumulation) or a plain tensor / numpy
    array (unquantized side, used as float64). bias: [N] or None, added in float64.
    With a plain side the product is an ordinary float64 matmul (relative error at most
    about K * 2^-53 of sum |x||w|, far below any low-precision tolerance).
    Computed on the CPU; returned on the device of xq (its codes, or the tensor itself).
    """
    device = (xq.codes if _is_qtensor(xq) else torch.as_tensor(xq)).device
    x = as_operand(xq, "xq")
    w = as_operand(wq, "wq")
    if len(w.lead) != 1:
        raise ValueError(f"wq must be 2-D [N, K], got leading shape {w.lead}")
    K = x.vals.shape[1]
    if w.vals.shape[1] != K:
        raise ValueError(f"contraction sizes differ: xq has K={K}, wq has K={w.vals.shape[1]}; "
                         f"wq must be [N, K] (out = x @ w.T)")
    M, N = x.vals.shape[0], w.vals.shape[0]
    if not (x.exact and w.exact):
        out = x.dequantized() @ w.dequantized().T
    else:
        # K-blocks on which both sides' scales are constant: boundaries of either side's groups
        # are multiples of gcd(group_x, group_w).
        gc = math.gcd(x.group, w.group)
        nb = K // gc
        sx = x.scale.repeat_interleave(x.group // gc, dim=1)  # [M, nb]
        sw = w.scale.repeat_interleave(w.group // gc, dim=1)  # [N, nb]
        if nb == 1:
            out = exact_int_matmul(x.vals, w.vals, x.bound, w.bound) * (sx[:, :1] * sw[:, 0][None, :])
        else:
            out = torch.zeros(M, N, dtype=torch.float64)
            buf = torch.empty(M, N, dtype=torch.float64)
            fits = gc * x.bound * w.bound < _EXACT  # one block's integer dot is exact in BLAS
            for j in range(nb):
                xs, ws = x.vals[:, j * gc:(j + 1) * gc], w.vals[:, j * gc:(j + 1) * gc]
                if fits:
                    torch.mm(xs, ws.T, out=buf)
                else:
                    buf.copy_(exact_int_matmul(xs, ws, x.bound, w.bound))
                # Scales applied to the exact block sum, then summed over blocks in float64:
                # a few roundings of 2^-53 each per block, nothing of the codes' products.
                buf.mul_(sx[:, j:j + 1])
                out.addcmul_(buf, sw[:, j][None, :])
    if bias is not None:
        bias = torch.as_tensor(bias).detach().to("cpu", torch.float64)
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},) (one per output channel), got {tuple(bias.shape)}")
        out = out + bias
    return out.reshape(*x.lead, N).to(device)


def sum_abs_products(xq, wq) -> torch.Tensor:
    """sum_k |x_q[m,k]| * |w_q[n,k]| in float64, [M, N]: the scale of every rounding error an
    accumulator can make (Higham's bound is in units of this sum)."""
    x, w = as_operand(xq, "xq"), as_operand(wq, "wq")
    return x.dequantized().abs() @ w.dequantized().abs().T
