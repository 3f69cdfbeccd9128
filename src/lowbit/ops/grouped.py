"""Grouped GEMM of mixture-of-experts layers: routing, scale layouts, float64 reference.

A grouped GEMM multiplies the tokens routed to each expert by that expert's weight, for all
experts in one pass. Its A operand is the token buffer sorted by expert: the M_total = T * top_k
(token, slot) pairs that were not dropped, expert 0's rows first; rows
offsets[e] : offsets[e + 1] belong to expert e (an empty expert has no rows). B is the stacked
per-expert weights [E, N, K], each expert with its own scales.

Scale layouts (the grouped MX layout of CATLASS's example), for one-byte scale codes packed
four per uint32 word along K (lowbit.packing.pack_scales, group-major), word group g:
  SFA[g * M_total + m]             A's scales, group-major over the CONCATENATED M
  SFB[g * E * N + e * N + n]       B's scales, group-major over (E, N)
Three indices (group, expert, row/column): the easiest scale layout to get wrong; the planted
bugs of lowbit.verify.grouped each name one way.

`grouped_reference` is the float64 quantization-aware reference: per expert, exactly
lowbit.ops.reference.qlinear_reference on that expert's rows (exact integer accumulation,
scales applied per K block), so a grouped kernel must match it as a dense one matches
qlinear_reference.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from lowbit.ops.reference import qlinear_reference
from lowbit.packing import pack_scales, unpack_scales
from lowbit.quantize import QTensor


@dataclass(frozen=True)
class Routing:
    """The sorted token buffer of one MoE call.

    token:   int64 [R], the token (row of hidden_states) of each sorted row.
    slot:    int64 [R], its top-k position (which routing weight applies).
    offsets: int64 [E + 1], rows of expert e are offsets[e]:offsets[e + 1].
    num_tokens: T, rows of hidden_states.
    inverse: int64 [T * top_k] or None, the sorted row of each (token, slot) pair in row-major order
             (route_fixed's; a dropped slot's row is past offsets[-1]): what `combine` reads.
    R = offsets[-1] (= M_total) from sort_tokens; route_fixed's buffer has R = T * top_k rows,
    those past offsets[-1] (dropped slots) owned by no expert.
    """
    token: torch.Tensor
    slot: torch.Tensor
    offsets: torch.Tensor
    num_tokens: int
    inverse: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def rows(self) -> int:
        return int(self.token.numel())

    def counts(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def expert_of_rows(self) -> torch.Tensor:
        """int64 [M_total]: the expert each sorted row belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_experts, device=self.offsets.device), self.counts())


def _check_top_k(top_k_index, num_experts: int) -> tuple[int, int]:
    """(T, top_k) of a router's top-k expert ids [tokens, top_k]: the shape checks both routings
    share (an integer 2-D tensor, at least one token, 1 <= top_k <= num_experts)."""
    if not isinstance(top_k_index, torch.Tensor) or top_k_index.ndim != 2 or top_k_index.is_floating_point():
        raise ValueError("top_k_index must be an integer tensor [tokens, top_k], got "
                         f"{getattr(top_k_index, 'dtype', type(top_k_index).__name__)} "
                         f"{tuple(getattr(top_k_index, 'shape', ()))}")
    T, k = top_k_index.shape
    if T == 0:
        raise ValueError("top_k_index has 0 tokens: a grouped GEMM of an empty batch has nothing to route; "
                         "skip the MoE call for an empty batch")
    if k < 1 or k > num_experts:
        raise ValueError(f"top_k = {k} must be in [1, num_experts = {num_experts}]: a token cannot pick more "
                         "distinct experts than exist; fix num_experts_per_tok")
    return T, k


def sort_tokens(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort the (token, slot) pairs of top_k_index [T, top_k] by expert (stable: within an
    expert, tokens keep their order). An index equal to num_experts is a dropped slot
    (transformers' expert-parallel marker) and gets no row. Raises ValueError on a non-integer
    or non-2-D index, T = 0, top_k > num_experts, or an index outside [0, num_experts]."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    T, k = _check_top_k(top_k_index, num_experts)
    flat = top_k_index.reshape(-1).to(torch.int64)
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi > num_experts:
        raise ValueError(f"top_k_index holds expert ids in [{lo}, {hi}]; valid ids are 0..{num_experts - 1} "
                         f"({num_experts} marks a dropped slot): the router and the experts disagree on E")
    keep = torch.nonzero(flat < num_experts).reshape(-1)
    order = keep[torch.argsort(flat[keep], stable=True)]
    counts = torch.bincount(flat[keep], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return Routing(order // k, order % k, offsets, T)


def route_fixed(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """sort_tokens for the fast path: device operations only, no host synchronisation, every
    shape fixed by (T, top_k, E), so CUDA graphs and torch.compile capture it. The buffer has
    capacity R = T * top_k rows: the kept (token, slot) pairs sorted by expert (stable), then the
    dropped slots (index == num_experts) after offsets[E], which no expert owns (a grouped kernel
    leaves their rows zero). Only the shape is checked (2-D integer, T >= 1, top_k <= E): expert
    ids are trusted here; lowbit.ops.grouped.sort_tokens (the exact path) checks their range."""
    T, k = _check_top_k(top_k_index, num_experts)
    flat = top_k_index.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=flat.device)
    return Routing(order // k, order % k, offsets, T, inverse)


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """route_fixed's Routing; on CUDA outside torch.compile, for T * top_k up to
    lowbit.ops.triton.moe_route.ROUTE_MAX_ROWS (decode), computed in one launch (route_small, equal
    bit for bit) instead of about ten."""
    T, k = _check_top_k(top_k_index, num_experts)
    if top_k_index.is_cuda and not torch.compiler.is_compiling():
        mr = _moe_route()
        if T * k <= mr.ROUTE_MAX_ROWS:
            token, slot, offsets, inverse = mr.route_small(top_k_index, num_experts)
            return Routing(token, slot, offsets, T, inverse)
    return route_fixed(top_k_index, num_experts)


def _moe_route():
    """lowbit.ops.triton.moe_route, the one-launch routing and combine (imported on first use)."""
    from lowbit.ops.triton import moe_route    # optional: triton

    return moe_route


def combine(h: torch.Tensor, top_k_weights: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """out [T, H] of `dtype`: each token's top_k expert outputs weighted and summed,
    out[t] = sum over s in slot order of float32(w[t, s]) * h[inverse[t, s]], every product and sum
    rounded to float32 (deterministic: a fixed order, unlike an index_add_ whose CUDA atomics add in
    any order), then one rounding to `dtype`. h [R, H] float32: the sorted rows' expert outputs, zero
    on rows no expert owns (dropped slots add w * 0). On CUDA outside torch.compile, one launch
    (lowbit.ops.triton.moe_route.combine_small, the same arithmetic; under torch.compile inductor
    fuses this loop and may contract a product and a sum into one rounding)."""
    if routing.inverse is None:
        raise ValueError("combine needs the routing's inverse (route / route_fixed make it)")
    T, k = top_k_weights.shape
    if h.is_cuda and not torch.compiler.is_compiling() and h.stride(1) == 1:
        return _moe_route().combine_small(h, top_k_weights, routing.inverse, dtype)
    rows = h[routing.inverse.reshape(T, k)]                        # [T, k, H]
    w = top_k_weights.to(torch.float32)
    acc = torch.zeros(T, h.shape[1], dtype=torch.float32, device=h.device)   # from +0, as the kernel's sum
    for s in range(k):
        acc = acc + rows[:, s] * w[:, s:s + 1]
    return acc.to(dtype)


def take_rows(q, rows: torch.Tensor):
    """Rows `rows` of an activation operand: a plain [M, K] tensor, or a QTensor whose scales
    are one row per code row (token / group strategies) or one for all rows (tensor)."""
    if not isinstance(q, QTensor):
        return q[rows]
    M = q.codes.shape[0]
    if q.codes.ndim != 2 or q.scale.shape[0] not in (1, M):
        raise ValueError(f"take_rows needs a 2-D QTensor with per-row or per-tensor scales, got codes "
                         f"{tuple(q.codes.shape)}, scale {tuple(q.scale.shape)}")
    per_row = q.scale.shape[0] == M        # M == 1: rows can only be 0, either reading agrees
    take = lambda t: None if t is None else (t[rows] if per_row else t)  # noqa: E731
    return replace(q, codes=q.codes[rows], scale=take(q.scale), zero_point=take(q.zero_point),
                   scale_codes=take(q.scale_codes), shape=(int(rows.numel()), q.shape[1]))


def grouped_reference(a, offsets: torch.Tensor, weights: Sequence, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Float64 [M_total, N]: rows offsets[e]:offsets[e+1] of `a` times expert e's weight.

    a:       [M_total, K] plain tensor (weight-only) or QTensor (activation codes and scales,
             per row or per tensor).
    offsets: int64 [E + 1] (Routing.offsets).
    weights: E per-expert QTensors [N, K] (or plain [N, K] tensors).
    bias:    [E, N] or None, added per expert in float64.
    Each expert's block is lowbit.ops.reference.qlinear_reference; empty experts give no rows."""
    E = int(offsets.numel()) - 1
    if len(weights) != E:
        raise ValueError(f"weights holds {len(weights)} experts, offsets describes {E}: pass one weight per expert")
    M = int(offsets[-1])
    rows_a = (a.codes if isinstance(a, QTensor) else a).shape[0]
    if rows_a != M:
        raise ValueError(f"a has {rows_a} rows, offsets[-1] = {M}: a must be the whole sorted token buffer")
    N = int((weights[0].shape if isinstance(weights[0], QTensor) else weights[0].shape)[0])
    out = torch.zeros(M, N, dtype=torch.float64)
    off = offsets.tolist()
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        if hi == lo:
            continue
        rows = torch.arange(lo, hi, device=(a.codes if isinstance(a, QTensor) else a).device)
        out[lo:hi] = qlinear_reference(take_rows(a, rows), weights[e],
                                       None if bias is None else bias[e]).cpu()
    return out


# ---------------------------------------------------------------------- scale layouts
def sfa_words(scale_codes: torch.Tensor) -> torch.Tensor:
    """uint32 flat SFA of the sorted buffer's scale codes uint8 [M_total, G]: word (g, m) at
    g * M_total + m (G not a multiple of 4: the last word group is padded with zero bytes)."""
    return pack_scales(scale_codes, "group_major", pad=True).reshape(-1)


def sfb_words(scale_codes: torch.Tensor) -> torch.Tensor:
    """uint32 flat SFB of stacked expert scale codes uint8 [E, N, G]: word (g, e, n) at
    g * E * N + e * N + n (the last word group zero-padded as in sfa_words)."""
    if scale_codes.ndim != 3:
        raise ValueError(f"sfb_words needs [E, N, G] scale codes, got {tuple(scale_codes.shape)}")
    E, N, G = scale_codes.shape
    return pack_scales(scale_codes.reshape(E * N, G), "group_major", pad=True).reshape(-1)


def scale_words_int32(scale_codes: torch.Tensor) -> torch.Tensor:
    """The group-major words of pack_scales(scale_codes [R, G], "group_major", pad=True), flat
    [ceil(G / 4) * R], as int32 bit patterns, made by moving bytes (word g * R + r holds codes
    r, 4g..4g+3, low byte first: a little-endian word's bytes in memory order), so no uint32
    arithmetic runs (CUDA's uint32 support is partial). Equal to sfa_words(codes).view(int32)."""
    R, G = scale_codes.shape
    c = torch.nn.functional.pad(scale_codes, (0, (-G) % 4)) if G % 4 else scale_codes
    return c.reshape(R, -1, 4).permute(1, 0, 2).contiguous().reshape(-1).view(torch.int32)


def read_sfa(words: torch.Tensor, M_total: int, G: int) -> torch.Tensor:
    """Inverse of sfa_words: uint8 [M_total, G]."""
    return unpack_scales(words.reshape(-1, M_total), "group_major", M_total, G)


def read_sfb(words: torch.Tensor, E: int, N: int, G: int) -> torch.Tensor:
    """Inverse of sfb_words: uint8 [E, N, G]."""
    return unpack_scales(words.reshape(-1, E * N), "group_major", E * N, G).reshape(E, N, G)
