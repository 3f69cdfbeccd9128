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
    num_experts experts: each expert adds at most block_m - 1 rows of padding, and each live tile
    holds at least one of the rows (at decode, a few rows over many experts, the second bound is the
    smaller: Qwen3-30B-A3B's 8 rows of one token over 128 experts make 8 tiles, not 120)."""
    return min(rows, (rows + num_experts * (block_m - 1)) // block_m)


@triton.jit
def tile_rows(off_ptr, tok_ptr, pid_m, E, K, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, IDENTITY: tl.constexpr):
    """(e int64, rows int32 [BM], valid [BM], token int64 [BM], k_end) of tile pid_m, found from the
    expert offsets alone (no schedule built before the launch: that was a dozen small device
    operations per call, each a launch in eager mode and a node in a CUDA graph). Expert e has
    ceil(count_e / BLOCK_M) tiles, in expert order; tile pid_m belongs to the first expert whose
    running tile count exceeds pid_m and starts at offsets[e] + (pid_m - tiles before e) * BLOCK_M.
    A tile past the last live one (pid_m < max_tiles, the static grid) has no valid row and
    k_end = 0 (its K loop runs no step). E_PAD: a power of two >= E."""
    ex = tl.arange(0, E_PAD)
    real = ex < E
    lo = tl.load(off_ptr + ex, mask=real, other=0).to(tl.int64)
    hi = tl.load(off_ptr + ex + 1, mask=real, other=0).to(tl.int64)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M                 # 0 on the padding lanes
    ends = tl.cumsum(tiles, 0)                                 # tiles of experts 0..e
    e = tl.sum((real & (ends <= pid_m)).to(tl.int32), 0)       # E: past the last live tile
    live = e < E
    mine = ex == tl.minimum(e, E - 1)
    row0 = tl.sum(tl.where(mine, lo + (pid_m - (ends - tiles)) * BLOCK_M, 0), 0)
    end = tl.sum(tl.where(mine, hi, 0), 0)
    rows = row0.to(tl.int32) + tl.arange(0, BLOCK_M)
    valid = (rows < end) & live
    if IDENTITY:
        tok = rows.to(tl.int64)
    else:
        tok = tl.load(tok_ptr + rows, mask=valid, other=0).to(tl.int64)
    k_end = tl.where(live, K, 0)
    return tl.minimum(e, E - 1).to(tl.int64), rows, valid, tok, k_end


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
    """(offsets, token, tiles, E_PAD) of a launch: the routing's own tensors (int64, read in the
    kernel: no conversion launched), the static number of tiles and tile_rows' E_PAD."""
    off = routing.offsets.contiguous()
    tok = off if identity else routing.token.contiguous()
    E = off.numel() - 1
    return off, tok, max_tiles(routing.rows, E, block_m), triton.next_power_of_2(E)
