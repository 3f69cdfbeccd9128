"""Error metrics for comparing a kernel's output with a reference.

All functions take torch tensors (any float dtype, CPU or CUDA) and compute in float64 on
the CPU, so a metric never adds rounding of its own that could hide a kernel's error.
Shapes: `got` and `ref` are [M, N] (a 1-D input is treated as one row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _as64(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    t = t.detach().to("cpu", torch.float64)
    if t.ndim == 1:
        t = t.unsqueeze(0)
    if t.ndim != 2:
        raise ValueError(f"{name} must be 1-D or 2-D [M, N], got shape {tuple(t.shape)}; "
                         f"reshape it to [-1, N] first")
    return t


def _pair(got, ref):
    g, r = _as64(got, "got"), _as64(ref, "ref")
    if g.shape != r.shape:
        raise ValueError(f"got has shape {tuple(g.shape)} but ref has {tuple(r.shape)}; "
                         f"they must match element for element")
    return g, r


def rel_l2(got, ref) -> float:
    """||got - ref||_2 / ||ref||_2 over all elements (inf when ref is all zero and got is not)."""
    g, r = _pair(got, ref)
    num = torch.linalg.vector_norm(g - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def max_abs_err(got, ref) -> tuple[float, tuple[int, int]]:
    """Largest |got - ref| and its (row, col); NaN anywhere counts as the largest error."""
    g, r = _pair(got, ref)
    e = (g - r).abs()
    e = torch.where(torch.isnan(e), torch.full_like(e, math.inf), e)
    flat = int(torch.argmax(e).item())
    row, col = divmod(flat, e.shape[1])
    return float(e[row, col].item()), (row, col)


def rms_err(got, ref) -> float:
    """Root mean square of got - ref."""
    g, r = _pair(got, ref)
    return float(torch.sqrt(torch.mean((g - r) ** 2)).item())


def mismatch_ratio(got, ref, rtol: float, atol: float) -> float:
    """Fraction of elements with |got - ref| > atol + rtol * |ref| (torch.allclose's rule)."""
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    g, r = _pair(got, ref)
    bad = ~((g - r).abs() <= atol + rtol * r.abs())  # NaN compares False, so it counts as bad
    return float(bad.double().mean().item())


def sqnr_db(ref, approx) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum ref^2 / sum (ref - approx)^2), in dB.
    inf when approx equals ref exactly."""
    r, a = _pair(ref, approx)
    noise = torch.sum((r - a) ** 2).item()
    sig = torch.sum(r ** 2).item()
    if noise == 0.0:
        return math.inf
    if not math.isfinite(noise):       # NaN / Inf in approx: no signal survives it
        return -math.inf
    if sig == 0.0:
        return -math.inf
    return 10.0 * math.log10(sig / noise)


def worst_per_row(got, ref) -> torch.Tensor:
    """max_n |got - ref| for each row: float64 [M]."""
    g, r = _pair(got, ref)
    return (g - r).abs().amax(dim=1)


def worst_per_col(got, ref) -> torch.Tensor:
    """max_m |got - ref| for each column: float64 [N]."""
    g, r = _pair(got, ref)
    return (g - r).abs().amax(dim=0)


def kl_sum(ref_logp: torch.Tensor, logits: torch.Tensor) -> float:
    """Sum over tokens of KL(P_ref || Q) in nats: ref_logp float64 log-softmax [n, vocab] of the
    reference, logits [n, vocab] of the model (log-softmaxed here in float64)."""
    lq = torch.log_softmax(logits.double(), dim=-1)
    return float((ref_logp.exp() * (ref_logp - lq)).sum())


@dataclass
class Census:
    """Distinct codes used per channel (row of codes) or per group."""

    used: torch.Tensor        # int64 [R] or [R, G]: distinct codes in each channel / group
    available: int            # codes the format offers (int8: 255 with symmetric clamp, else 2^bits)
    worst: int                # smallest entry of `used`
    worst_index: tuple        # (row,) or (row, group) of the worst entry

    def describe(self) -> str:
        where = "channel %d" % self.worst_index[0] if len(self.worst_index) == 1 else \
            "channel %d group %d" % self.worst_index
        return f"{self.worst} of {self.available} codes used ({where})"


def code_census(codes: torch.Tensor, available: int, group_size: int | None = None) -> Census:
    """Count distinct code values per row of `codes` [R, K] (per channel), or per group of
    `group_size` consecutive elements along K. `available` is how many codes the scheme can use
    (symmetric int8 spends 255). Works for integer values and uint8 bit patterns."""
    if codes.ndim != 2:
        raise ValueError(f"codes must be 2-D [R, K], got shape {tuple(codes.shape)}")
    c = codes.detach().to("cpu", torch.int64)
    R, K = c.shape
    if group_size is not None:
        if group_size <= 0 or K % group_size:
            raise ValueError(f"group_size={group_size} must divide K={K}")
        c = c.reshape(R * (K // group_size), group_size)
    # Distinct values per row: sort each row and count the steps.
    s, _ = torch.sort(c, dim=1)
    used = 1 + (s[:, 1:] != s[:, :-1]).sum(dim=1)
    if group_size is not None:
        used = used.reshape(R, K // group_size)
    flat = int(torch.argmin(used).item())
    idx = (flat,) if used.ndim == 1 else divmod(flat, used.shape[1])
    return Census(used=used, available=int(available), worst=int(used.min().item()), worst_index=tuple(idx))


def summary(got, ref) -> dict:
    """The usual trio (relative L2, max error and where, mismatch is
    gate-specific and lives in the Verdict) plus rms and SQNR."""
    err, where = max_abs_err(got, ref)
    return {"rel_l2": rel_l2(got, ref), "max_abs_err": err, "max_at": where,
            "rms_err": rms_err(got, ref), "sqnr_db": sqnr_db(ref, got)}
