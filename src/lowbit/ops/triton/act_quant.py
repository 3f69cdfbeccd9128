"""Dynamic per-token activation quantization on the GPU, feeding the W8A8 GEMMs.

One program per row (token): a first pass over K finds the row's range, a second writes the
codes. The arithmetic is lowbit.quantize's canonical one (docs/formats.md), reproduced
bit for bit: IEEE division (`div_rn`, not x * (1/s)), round-half-even, an all-zero row gets
scale 1.0 (so no NaN), and
- int8 symmetric:  s = absmax / 127,  q = clamp(rint(x / s), -127, 127)
- int8 asymmetric: s = (max(x,0) - min(x,0)) / 255, z = clamp(rint(-128 - min(x,0) / s), -128, 127),
                   q = clamp(rint(x / s) + z, -128, 127)
- fp8 e4m3fn:      s = absmax / 448,  codes = encode(x / s, saturate=True)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.quantize import QTensor
from .common import check_device, encode_e4m3fn, launch, nonzero_quotient, rint

MODES = ("int8", "int8_asym", "fp8_e4m3fn")


@triton.jit
def sym_codes(x, s, FP8: tl.constexpr):
    """The codes of fp32 x at scale s: int8 clamp(rint(x / s), -127, 127), or the e4m3fn bits of x / s
    (saturating). x / s is IEEE division; clamping to +-128 first keeps rint exact."""
    v = tl.math.div_rn(x, s)
    if FP8:
        q = encode_e4m3fn(v)
    else:
        q = tl.minimum(tl.maximum(rint(tl.minimum(tl.maximum(v, -128.0), 128.0)), -127.0), 127.0).to(tl.int8)
    return q


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, z_ptr, K, stride_xm, stride_qm,
                      MODE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    hi = tl.zeros((BLOCK,), dtype=tl.float32)
    lo = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=offs < K - k0, other=0.0).to(tl.float32)
        hi = tl.maximum(hi, x)
        lo = tl.minimum(lo, x)
    hi_r = tl.max(hi, axis=0)  # max(x, 0): the accumulators started at 0
    lo_r = tl.min(lo, axis=0)  # min(x, 0)
    if MODE == 0:
        s = nonzero_quotient(tl.maximum(hi_r, -lo_r), 127.0)
    elif MODE == 1:
        s = nonzero_quotient(hi_r - lo_r, 255.0)
    else:
        s = nonzero_quotient(tl.maximum(hi_r, -lo_r), 448.0)
    tl.store(s_ptr + row, s)
    if MODE == 1:
        z = tl.minimum(tl.maximum(rint(-128.0 - tl.math.div_rn(lo_r, s)), -128.0), 127.0)
        tl.store(z_ptr + row, z.to(tl.int32))
    for k0 in range(0, K, BLOCK):
        ok = offs < K - k0
        x = tl.load(x_row + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        if MODE == 0:
            tl.store(q_row + k0 + offs, sym_codes(x, s, False), mask=ok)
        elif MODE == 1:
            v = tl.math.div_rn(x, s)
            q = rint(tl.minimum(tl.maximum(v, -512.0), 512.0)) + z
            q = tl.minimum(tl.maximum(q, -128.0), 127.0)
            tl.store(q_row + k0 + offs, q.to(tl.int8), mask=ok)
        else:
            tl.store(q_row + k0 + offs, sym_codes(x, s, True), mask=ok)


def quantize_per_token(x: torch.Tensor, mode: str = "int8", *, check_finite: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize each row of x [..., K] (fp32 / bf16 / fp16) with its own scale.

    mode: "int8" (symmetric), "int8_asym" or "fp8_e4m3fn". Returns (codes, scale, zero_point):
    codes [..., K] int8 (int modes) or uint8 e4m3fn bit patterns; scale fp32 [..., 1] (the
    effective scale, as in QTensor.scale); zero_point int32 [..., 1] for int8_asym, else None.
    check_finite: reject NaN/Inf rows (costs a device->host sync; benchmarks and CUDA graphs
    turn it off).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {MODES}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("x must be a float32, bfloat16 or float16 tensor")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (K) axis, got shape {tuple(x.shape)}")
    check_device("x", x)
    if check_finite and not bool(torch.isfinite(x).all()):
        raise ValueError("x contains NaN or Inf; a per-token scale would be meaningless: fix the input")
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    q, s, z = launch_act_quant(x2, mode)
    return (q.reshape(*lead, K), s.reshape(*lead, 1),
            None if z is None else z.reshape(*lead, 1))


def launch_act_quant(x2: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel launch alone, no checks (the prepared runtime checks once, at prepare time):
    x2 [M, K] with unit stride along K -> codes [M, K], scale fp32 [M], zero point int32 [M] or None."""
    M, K = x2.shape
    qdtype = torch.uint8 if mode == "fp8_e4m3fn" else torch.int8
    q = torch.empty((M, K), dtype=qdtype, device=x2.device)
    s = torch.empty((M,), dtype=torch.float32, device=x2.device)
    z = torch.empty((M,), dtype=torch.int32, device=x2.device) if mode == "int8_asym" else None
    if M:
        block = min(triton.next_power_of_2(K), 4096)
        launch(_act_quant_kernel, (M,), x2, q, s, z if z is not None else s, K, x2.stride(0), q.stride(0),
               MODE=MODES.index(mode), BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, s, z


def quantize_tokens(x: torch.Tensor, scheme, *, check_finite: bool = True):
    """The kernel's result as a lowbit QTensor, ready for lowbit.ops.linear (dynamic W8A8).

    scheme: a QuantScheme with one fp32 scale per row (strategy "token" or "channel"): int8
    symmetric or asymmetric, or fp8_e4m3fn. Any other scheme raises NotImplementedError; the
    result is bit-identical to lowbit.quantize(x, scheme) (tests check it)."""
    fmt = getattr(scheme, "format", None)
    per_row = getattr(scheme, "strategy", None) in ("token", "channel") and \
        getattr(scheme, "scale_format", None) == "fp32"
    if per_row and fmt == "int8":
        mode = "int8" if scheme.symmetric else "int8_asym"
    elif per_row and fmt == "fp8_e4m3fn":
        mode = "fp8_e4m3fn"
    else:
        raise NotImplementedError(f"quantize_tokens: no kernel for {scheme}; it covers one fp32 scale per "
                                  "row with int8 (symmetric or not) or fp8_e4m3fn; use lowbit.quantize")
    codes, scale, zero = quantize_per_token(x, mode, check_finite=check_finite)
    return QTensor(codes, scale, zero, scheme, tuple(x.shape))
