"""The tile schedule of lowbit's grouped MoE GEMMs (lowbit.ops.triton.grouped explains it) and the
pieces every grouped kernel shares: a tile's rows, the masked store, the argument checks."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.ops.grouped import Routing
from lowbit.ops.triton.fused_quant import round_to


def max_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound of sum_e ceil(count_e / block_m) over any split of `rows` rows into
    num_experts experts: each expert adds at most block_m - 1 rows of padding."""
    return (rows + num_experts * (block_m - 1)) // block_m


def block_schedule(offsets: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_expert int32 [max_tiles], block_row0 int32 [max_tiles]) of a sorted buffer of
    `rows` rows (its capacity; offsets[-1] <= rows) whose expert e owns rows
    offsets[e]:offsets[e + 1]. Tile t < sum_e ceil(count_e / block_m) belongs to expert e and
    starts at row offsets[e] + j * block_m (its j-th tile); later tiles get expert E and row 0.
    Device operations only: no host synchronisation, shapes fixed by (rows, E, block_m)."""
    off = offsets.to(torch.int64)
    E = off.numel() - 1
    tiles = (off[1:] - off[:-1] + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles(rows, E, block_m), device=off.device, dtype=torch.int64)
    e = torch.searchsorted(ends, t, right=True)                  # E past the last live tile
    ec = e.clamp(max=E - 1)
    row0 = off[ec] + (t - (ends - tiles)[ec]) * block_m
    live = e < E
    return e.to(torch.int32), torch.where(live, row0, 0).to(torch.int32)


@triton.jit
def tile_rows(bexp_ptr, brow_ptr, off_ptr, tok_ptr, pid_m, E, K, BLOCK_M: tl.constexpr, IDENTITY: tl.constexpr):
    """(e int64, rows int32 [BM], valid [BM], token int64 [BM], k_end) of tile pid_m: an unused
    tile (expert E) has no valid row and k_end = 0 (its K loop runs no step)."""
    e = tl.load(bexp_ptr + pid_m)
    live = e < E
    e = tl.minimum(e, E - 1).to(tl.int64)
    row0 = tl.load(brow_ptr + pid_m)
    end = tl.load(off_ptr + e + 1).to(tl.int32)
    rows = row0 + tl.arange(0, BLOCK_M)
    valid = (rows < end) & live
    if IDENTITY:
        tok = rows.to(tl.int64)
    else:
        tok = tl.load(tok_ptr + rows, mask=valid, other=0).to(tl.int64)
    k_end = tl.where(live, K, 0)
    return e, rows, valid, tok, k_end


@triton.jit
def store_rows(c_ptr, y, rows, valid, offs_n, n_ok, e, N, stride_c, bias_ptr, HAS_BIAS: tl.constexpr):
    """y (+ bias[e, n], in fp32) into the tile's valid sorted rows of C, rounded once to C's dtype
    (round to nearest even)."""
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + e * N + offs_n, mask=n_ok, other=0.0)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_c + offs_n[None, :], round_to(y, c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def check_routing(routing: Routing, T: int, E: int, identity: bool = False) -> None:
    """The routing fits activations of T rows and E experts (identity: A is the sorted buffer)."""
    if routing.num_experts != E:
        raise ValueError(f"routing has {routing.num_experts} experts, the weights {E}")
    if identity:
        if T != routing.rows:
            raise ValueError(f"the sorted buffer has {T} rows, the routing {routing.rows}")
    elif routing.num_tokens != T:
        raise ValueError(f"routing was made for {routing.num_tokens} tokens, the activations have {T}")
    if routing.rows == 0:
        raise ValueError("routing has no rows (every slot dropped or a zero-token batch): nothing to compute")


def check_bias(bias, E, N, device):
    if bias is None:
        return None
    b = torch.as_tensor(bias)
    if tuple(b.shape) != (E, N):
        raise ValueError(f"bias must be [E = {E}, N = {N}], got {tuple(b.shape)}")
    return b.to(device, torch.float32).contiguous()


def schedule_args(routing: Routing, block_m: int, identity: bool):
    """(block_expert, block_row0, offsets int32, token int32, tiles) for a launch."""
    bexp, brow = block_schedule(routing.offsets, routing.rows, block_m)
    off = routing.offsets.to(torch.int32).contiguous()
    tok = off if identity else routing.token.to(torch.int32).contiguous()
    return bexp, brow, off, tok, bexp.numel()


