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
            dist.recv(run, src=r - 1)
            while self._terms:       # in batch order, each freed once added
                run += self._terms.pop(0).to(dev)
        if r < w - 1:
            dist.send(run, dst=r + 1)
        dist.broadcast(run, src=w - 1)
        self._count = 0
        return run.to(out_dev)
