"""An MoE call's routing and its combine, one launch each, for decode-sized batches.

`route_fixed` (lowbit.ops.grouped) sorts the (token, slot) pairs by expert with a stable argsort, a
count, a cumulative sum and a few index operations: about ten device operations, each a launch in
eager mode and a node in a CUDA graph, for a few dozen rows at decode. `route_small` computes the
same Routing (bit for bit: the same stable order, offsets and inverse) in one program: the sorted
row of pair i is a stable counting sort's,

    row(i) = #{j : id_j < id_i} + #{j < i : id_j == id_i}

(dropped slots, id == E, land after every expert's rows, as route_fixed puts them), found by
comparing all R x R pairs, so it is for R = T * top_k <= ROUTE_MAX_ROWS; the offsets are the
exclusive cumulative sum of the ids' histogram.

`combine_small` is the weighted sum of each token's top_k expert outputs,
out[t] = sum over s = 0..top_k-1 of w[t, s] * h[inverse[t, s]], in float32, products and sums each
rounded once (no fused multiply-add) and summed in slot order, then one rounding to the output
dtype: lowbit.ops.grouped.combine's arithmetic, bit for bit, where an index_add_ over the sorted rows
would add them in whatever order its atomics land (a different float32 sum from run to run for
top_k > 2)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.triton.common import launch
from lowbit.ops.triton.fused_quant import round_to

ROUTE_MAX_ROWS = 128      # R x R comparisons in one program's registers


@triton.jit
def _route_kernel(idx_ptr, token_ptr, slot_ptr, off_ptr, inv_ptr, R, E, TOP_K: tl.constexpr, R_PAD: tl.constexpr,
                  E_PAD: tl.constexpr):
    i = tl.arange(0, R_PAD)
    real = i < R
    ids = tl.load(idx_ptr + i, mask=real, other=0).to(tl.int32)
    ids = tl.where(real, ids, E + 1)                 # padding lanes sort after the dropped slots (id E)
    ahead = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None]))
    row = tl.sum(ahead.to(tl.int32), 1)
    tl.store(token_ptr + row, (i // TOP_K).to(tl.int64), mask=real)
    tl.store(slot_ptr + row, (i % TOP_K).to(tl.int64), mask=real)
    tl.store(inv_ptr + i, row.to(tl.int64), mask=real)
    counts = tl.histogram(ids, E_PAD, mask=real)      # bins 0..E-1 the experts, E the dropped slots
    ex = tl.arange(0, E_PAD)
    off = tl.cumsum(counts, 0) - counts
    tl.store(off_ptr + ex, off.to(tl.int64), mask=ex <= E)


@triton.jit
def _combine_kernel(h_ptr, w_ptr, inv_ptr, out_ptr, H, stride_h, stride_w, stride_o, TOP_K: tl.constexpr,
                    BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        r = tl.load(inv_ptr + t * TOP_K + s)
        w = tl.load(w_ptr + t * stride_w + s).to(tl.float32)
        acc += w * tl.load(h_ptr + r * stride_h + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, round_to(acc, out_ptr.dtype.element_ty), mask=ok)


def route_small(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """(token, slot, offsets, inverse) of lowbit.ops.grouped.route_fixed's Routing in one launch, for T * top_k <=
    ROUTE_MAX_ROWS (the caller checks the shape; ids are trusted, as route_fixed trusts them)."""
    T, k = top_k_index.shape
    R = T * k
    if R > ROUTE_MAX_ROWS:
        raise ValueError(f"route_small takes T * top_k <= {ROUTE_MAX_ROWS} rows, got {R}: use route_fixed")
    dev = top_k_index.device
    token, slot, inv = (torch.empty(R, dtype=torch.int64, device=dev) for _ in range(3))
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=dev)
    launch(_route_kernel, (1,), top_k_index.contiguous(), token, slot, offsets, inv, R, num_experts, TOP_K=k,
           R_PAD=max(16, triton.next_power_of_2(R)), E_PAD=triton.next_power_of_2(num_experts + 2), num_warps=4)
    return token, slot, offsets, inv


def combine_small(h: torch.Tensor, top_k_weights: torch.Tensor, inverse: torch.Tensor, dtype: torch.dtype
                  ) -> torch.Tensor:
    """out [T, H] of `dtype`: lowbit.ops.grouped.combine in one launch (h [R, H], the sorted rows' expert
    outputs, zero on rows no expert owns; top_k_weights [T, top_k]; inverse [T * top_k] the Routing's)."""
    T, k = top_k_weights.shape
    H = h.shape[1]
    out = torch.empty(T, H, dtype=dtype, device=h.device)
    w = top_k_weights if top_k_weights.stride(1) == 1 else top_k_weights.contiguous()
    block = min(1024, max(16, triton.next_power_of_2(H)))
    launch(_combine_kernel, (T, triton.cdiv(H, block)), h, w, inverse, out, H, h.stride(0), w.stride(0),
           out.stride(0), TOP_K=k, BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out
