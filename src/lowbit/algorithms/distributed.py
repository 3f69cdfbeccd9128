"""Data-parallel calibration over torch.distributed: the reductions lowbit's calibration calls make
when a process group is initialized (torchrun, or init_process_group in a user's script).

Each rank runs ITS share of the calibration batches; the statistics are then combined so that
every rank holds the result of all ranks' batches together:
  absmax statistics (SmoothQuant, static activation scales, per-channel maxima)  MAX    exact
  GPTQ / AWQ Hessians X^T X and AWQ's sum |X|                                     ordered SUM  exact
  per-site SQNR sums (a report, not an input to any code)                         SUM (float64)
  token / row counts                                                              SUM (int64)  exact
MAX is order-free, so the absmax statistics are bit-identical to one process's. A float64 SUM
is not (addition is not associative), so the sums that decide codes are reduced in ORDER:
every batch's term P_b (e.g. X_b^T X_b, computed where the batch lives) is kept, rank 0 adds
its terms to zero in batch order and sends the running sum to rank 1, which adds its terms,
and so on; the last rank broadcasts the total. With contiguous shares in rank order
(`shard`), that is the same sequence of float64 additions one process performs, so the Hessian
and every GPTQ code are bit-identical to the single-process run (given that one batch's
P_b = X_b^T X_b comes out the same in both, i.e. the same device kind, dtype and matmul
library). The price: each rank holds its batches' terms until its turn ([K, K] float64 each,
1.6 GB for K = 14336) and the world-1 additions of the chain run one after another; the
matmuls themselves run in parallel.

Nothing here is a home-made process pool: torch.distributed does the transport (gloo on CPU
tensors, NCCL on CUDA tensors; a tensor is moved to the backend's device for the collective
and back). Without an initialized group (or with one rank) every function is the identity.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

# torchrun sets these; `from_env` starts a group from them.
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def active() -> bool:
    """True when torch.distributed is initialized with more than one rank."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if active() else 0


def world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if active() else 1


def launched_by_torchrun() -> bool:
    """Whether the torchrun environment variables are all present."""
    return all(k in os.environ for k in _ENV)


def init_from_env(device: str = "auto") -> str:
    """Start the default process group from torchrun's environment (no-op when one exists).
    device: "cuda" (NCCL, one GPU per local rank), "cpu" (gloo) or "auto" (cuda when available).
    Returns the device string the rank should compute on ("cuda:<local rank>" or "cpu")."""
    import torch.distributed as dist
    if not launched_by_torchrun():
        missing = [k for k in _ENV if k not in os.environ]
        raise RuntimeError(f"--distributed needs torchrun's environment ({', '.join(missing)} missing): "
                           "launch with `torchrun --nproc-per-node N -m lowbit ...`")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: choose 'cuda' (NCCL), 'cpu' (gloo) or 'auto'")
    local = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA device(s): "
                               "give --nproc-per-node <= the number of GPUs")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return f"cuda:{local}" if device == "cuda" else "cpu"


def shard(items: Sequence) -> list:
    """This rank's contiguous share of `items` (ranks in order, sizes differing by at most one):
    the split under which the ordered sums reproduce one process's arithmetic. Raises when a
    rank would get nothing (every rank must run at least one batch through the model)."""
    items = list(items)
    n, w, r = len(items), world_size(), rank()
    if n < w:
        raise ValueError(f"{n} calibration batch(es) for {w} ranks: give at least one batch per rank "
                         "(more --calib-tokens or fewer processes)")
    lo, hi = share(n, w, r)
    return items[lo:hi]


def share(n: int, world: int, r: int) -> tuple[int, int]:
    """[lo, hi) of rank r's contiguous share of n items: ranks in order, sizes differing by at
    most one (the first n % world ranks get one more); empty when n < world for the last ranks."""
    lo = r * (n // world) + min(r, n % world)
    return lo, lo + n // world + (1 if r < n % world else 0)


def owners(costs: Sequence[float], world: int) -> list[int]:
    """A rank for each job of cost costs[j] (longest processing time first): jobs in decreasing
    cost, each to the least loaded rank so far, ties to the HIGHEST rank (rank 0 also writes
    the checkpoint). Every rank computes the same assignment from the same costs."""
    load, own = [0.0] * world, [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: -costs[j]):
        r = min(range(world), key=lambda r: (load[r], -r))
        own[j], load[r] = r, load[r] + costs[j]
    return own


def comm_device() -> torch.device:
    """The device the process group's backend communicates on (this rank's GPU for NCCL, else the
    CPU); the CPU without a group."""
    return _comm_device() if active() else torch.device("cpu")


def _comm_device() -> torch.device:
    import torch.distributed as dist
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _collective(t: torch.Tensor, fn) -> torch.Tensor:
    """Run fn(tensor on the backend's device) and return the result on t's device."""
    dev = _comm_device()
    buf = t.detach().to(dev).contiguous().clone()
    fn(buf)
    return buf.to(t.device)


def all_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of `t` over ranks (exact)."""
    if not active():
        return t
    import torch.distributed as dist
    return _collective(t, lambda b: dist.all_reduce(b, op=dist.ReduceOp.MAX))


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks. Integer tensors add exactly; float tensors must be float64 (the
    result differs from one process's running sum only by float64 rounding)."""
    if not active():
        return t
    if t.is_floating_point() and t.dtype != torch.float64:
        raise TypeError(f"all_sum of a {t.dtype} tensor: accumulate calibration sums in float64")
    import torch.distributed as dist
    return _collective(t, lambda b: dist.all_reduce(b, op=dist.ReduceOp.SUM))


def all_count(n: int) -> int:
    """Sum of an integer count over ranks."""
    return int(all_sum(torch.tensor([int(n)], dtype=torch.int64))[0]) if active() else int(n)


def broadcast_(t: torch.Tensor, src: int) -> None:
    """Overwrite `t` (same shape and dtype on every rank) with rank `src`'s values, in place."""
    if not active():
        return
    import torch.distributed as dist
    if t.is_contiguous() and t.device == _comm_device():
        dist.broadcast(t, src)       # in place: no staging copy
        return
    t.copy_(_collective(t, lambda b: dist.broadcast(b, src)))


# Ranks > 0 keep their terms until the running sum reaches them ([K, K] float64 each: 1.6 GB for
# K = 14336, times their batches). True: those terms wait in (page-locked) host memory and go
# back to the device one at a time when the chain reaches them; the same additions in the same
# order (bit-identical), at the price of copying every term out and back (PCIe: ~0.1 s per
# 1.6 GB term each way), so off by default. Rank 0 never keeps terms: its terms come first in
# the chain, so it adds them as they come, exactly as one process does.
TERMS_ON_HOST = False


def _park(term: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (page-locked, copied in stream order) to free its memory."""
    if term.device.type != "cuda":
        return term
    buf = torch.empty(term.shape, dtype=term.dtype, pin_memory=True)
    buf.copy_(term, non_blocking=True)
    return buf


class OrderedSum:
    """A float64 sum of per-batch terms that is bit-identical whatever the number of ranks.

    add(term): one batch's term (float64, any shape, on any device). total(): the sum over all
    ranks' terms in batch order, computed as 0 + P_0 + P_1 + ... exactly as one process does it
    (module docstring). One process, and rank 0 (whose terms start the chain): a running sum
    (nothing is kept). Ranks > 0 keep their terms until the chain reaches them, on the device or,
    with TERMS_ON_HOST, in host memory. total() is a collective: every rank must call it, in the
    same order as the other ranks' calls."""

    def __init__(self, terms_on_host: bool | None = None):
        self._dist = active()
        self._running = not self._dist or rank() == 0
        self._host = self._dist and (TERMS_ON_HOST if terms_on_host is None else terms_on_host)
        self._terms: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._device = None

    def add(self, term: torch.Tensor) -> None:
        if term.dtype != torch.float64:
            raise TypeError(f"OrderedSum term is {term.dtype}: calibration sums are float64")
        self._count += 1
        if self._device is None:
            self._device = term.device
        if self._running:
            if self._sum is None:
                self._sum = torch.zeros_like(term)
            self._sum += term
        else:
            self._terms.append(_park(term) if self._host else term)

    def total(self, shape, device=None) -> torch.Tensor | None:
        """The sum (float64 `shape`, on `device` or the terms' device), or None when no rank had
        a term. Every rank must pass the same shape."""
        if not self._dist:
            return self._sum
        import torch.distributed as dist
        r, w = dist.get_rank(), dist.get_world_size()
        dev = _comm_device()
        out_dev = device if device is not None else (self._device if self._device is not None else dev)
        # how many terms each rank holds (to know whether anyone had one)
        have = all_count(self._count)
        if have == 0:
            return None
        if r == 0:
            run = (self._sum.to(dev) if self._sum is not None else
                   torch.zeros(tuple(shape), dtype=torch.float64, device=dev))
            self._sum = None
        else:
            run = torch.zeros(tuple(shape), dtype=torch.float64, device=dev)
            _pass_on(run, r - 1, r, r)
            while self._terms:       # in batch order, each freed once added
                run += self._terms.pop(0).to(dev)
        if r < w - 1:
            _pass_on(run, r, r + 1, r)
        dist.broadcast(run, src=w - 1)
        self._count = 0
        return run.to(out_dev)


def counts(n: int) -> list[int]:
    """Every rank's count `n` (e.g. its number of calibration batches), in rank order: [n] in one
    process; under torch.distributed a collective (one all_gather of one int64)."""
    if not active():
        return [int(n)]
    import torch.distributed as dist
    mine = torch.tensor([int(n)], dtype=torch.int64, device=_comm_device())
    got = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine)
    return [int(t) for t in got]


# Chunks of a ChunkedSum: the batches are cut into CHAIN_CHUNKS runs of C = ceil(n / CHAIN_CHUNKS)
# consecutive batches (n: all ranks' batches), whatever the number of ranks. A rank > 0 then holds
# about CHAIN_CHUNKS / world chunk sums until the chain reaches it (2 for 2 ranks: 3.1 GB for
# K = 14336) instead of one term per batch (8 batches: 12.2 GiB); with more
# ranks than chunks, or shares that chunks do not line up with, a chunk spans ranks and the later
# rank adds its first batches' terms when the chain reaches it (correct, but on the chain).
CHAIN_CHUNKS = 4


def _pass_on(t: torch.Tensor, src: int, dst: int, me: int) -> None:
    """Rank src's t to rank dst (in place on dst): a broadcast for two ranks (the group's own
    communicator: no NCCL point-to-point communicator to start), send / recv otherwise."""
    import torch.distributed as dist
    if dist.get_world_size() == 2:
        dist.broadcast(t, src)
    elif me == src:
        dist.send(t, dst=dst)
    else:
        dist.recv(t, src=src)


class ChunkedSum:
    """A float64 sum of per-batch terms in a canonical order that does not depend on the number of
    ranks, holding few partial sums on any rank.

    The batches are numbered across ranks (rank r's first is the sum of the counts before it:
    `counts` from the function of that name, with shard's contiguous shares) and cut into chunks
    of C = ceil(n / CHAIN_CHUNKS) consecutive batches. A chunk's sum starts at zero and takes its
    batches' terms in order, each term accumulated INTO it by the caller's function (e.g.
    `lambda s: s.addmm_(x.T, x)`: the product is never a separate K x K matrix); the total is
    S_0 + S_1 + ... added in chunk order. One process and N ranks perform exactly these
    operations on the same operands, so the total is bit-identical for any number of ranks
    (given the same device kind and libraries). Each rank fills its chunks as its batches come;
    rank 0 adds its chunks to the total at once. total() is the chain: rank r receives the total
    so far (and the sum of a chunk begun on an earlier rank, which it continues with its first
    batches' terms), adds its closed chunks in order and passes them on; the last rank
    broadcasts the total. A collective: every rank calls it, in the same order.
    add(into): one batch's term; into(s) adds it into the float64 tensor s in place."""

    def __init__(self, counts: list[int], shape, device, chunks: int | None = None):
        self._counts = [int(c) for c in counts]
        self._world = len(self._counts)
        self._me = rank() if self._world > 1 else 0
        if self._world != world_size():
            raise ValueError(f"counts has {self._world} entries for {world_size()} rank(s): pass distributed.counts(n)")
        self._first = sum(self._counts[:self._me])
        self._end = self._first + self._counts[self._me]
        self._n = sum(self._counts)
        self._c = max(1, -(-self._n // (chunks or CHAIN_CHUNKS)))
        self._shape, self._device = tuple(shape), torch.device(device)
        self._next = self._first          # the global index of the next term
        self._lead: list = []             # terms of a chunk begun on an earlier rank (added on the chain)
        self._closed: list[torch.Tensor] = []   # ranks > 0: closed chunk sums, in order
        self._total: torch.Tensor | None = None  # rank 0: the closed chunks' running total
        self._open: torch.Tensor | None = None   # the chunk being filled

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self._shape, dtype=torch.float64, device=self._device)

    def _ends(self, i: int) -> bool:
        """Whether global batch i is the last of its chunk."""
        return (i + 1) % self._c == 0 or i + 1 == self._n

    def add(self, into) -> None:
        i = self._next
        if i >= self._end:
            raise RuntimeError(f"ChunkedSum: more terms than the {self._end - self._first} this rank announced")
        self._next += 1
        if i - i % self._c < self._first:     # its chunk began on an earlier rank
            self._lead.append(into)
            return
        if self._open is None:
            self._open = self._zeros()
        into(self._open)
        if self._ends(i):
            s, self._open = self._open, None
            if self._first == 0:              # rank 0 (or one process): chunks come in order
                self._total = s if self._total is None else self._total.add_(s)
            else:
                self._closed.append(s)

    def total(self) -> torch.Tensor | None:
        """The sum over all ranks' terms (float64, on the device given), or None when n == 0."""
        if self._next != self._end:
            raise RuntimeError(f"ChunkedSum: {self._next - self._first} terms added, "
                               f"{self._end - self._first} announced")
        if self._n == 0:
            return None
        if self._world == 1:
            return self._total
        import torch.distributed as dist
        dev, me, c = _comm_device(), self._me, self._c
        total, part = self._total, None
        if total is not None:
            total = total.to(dev)
        if me > 0:       # the total so far (chunks closed before my first batch), a chunk begun earlier
            if self._first >= c:
                total = torch.empty(self._shape, dtype=torch.float64, device=dev)
                _pass_on(total, me - 1, me, me)
            if self._first % c and self._first < self._n:
                part = torch.empty(self._shape, dtype=torch.float64, device=dev)
                _pass_on(part, me - 1, me, me)
            for into in self._lead:           # my first batches continue that chunk
                into(part)
            self._lead = []
            if part is not None and self._lead_closes():
                total = part if total is None else total.add_(part)
                part = None
            while self._closed:
                s = self._closed.pop(0).to(dev)
                total = s if total is None else total.add_(s)
        if self._open is not None:            # my last chunk goes on on the next rank
            if part is not None:
                raise AssertionError("ChunkedSum: two open chunks")
            part = self._open.to(dev)
            self._open = None
        if me < self._world - 1:
            if self._end >= c:
                _pass_on(total, me, me + 1, me)
            if self._end % c and self._end < self._n:
                _pass_on(part, me, me + 1, me)
        if total is None:
            total = torch.empty(self._shape, dtype=torch.float64, device=dev)
        dist.broadcast(total, src=self._world - 1)
        self._total = None
        return total.to(self._device)

    def _lead_closes(self) -> bool:
        """Whether the chunk begun on an earlier rank ends within this rank's batches."""
        c0 = self._first - self._first % self._c
        return min(c0 + self._c, self._n) <= self._end
