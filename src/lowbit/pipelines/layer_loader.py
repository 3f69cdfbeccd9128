"""One decoder layer's tensors from a (sharded) safetensors checkpoint onto the device, the
reading split over the ranks of torch.distributed.

The layer's parameters are laid end to end (named_parameters order, counted in elements of
the compute dtype, so that a share of elements is a share of the bytes moved); rank r reads
the contiguous share `distributed.share(total, world, r)` of them from the files (ranged reads
straight into one host staging buffer, page-locked for a GPU, several chunks at once), copies
it into the layer's parameters on its device, and each piece is then broadcast from the rank
that read it (NCCL over NVLink on GPUs, gloo on CPUs). No rank reads the whole layer, and the
parameters are filled in place: no second copy of the layer exists on the device. One
process is the case world = 1 (it reads everything, nothing is broadcast).

A parameter need not be one checkpoint tensor: plan's `sources` gives the tensors whose
concatenation it is. model_sources maps a MoE model's fused experts weights (transformers 5:
gate_up [E, 2I, H], down [E, H, I] in memory) to the per-expert tensors its save_pretrained
writes, each read straight into its rows, and the family's renamed block (Mixtral's
block_sparse_moe); persistent buffers (DeepSeek-V3's e_score_correction_bias) are read as
parameters are.

The embedding rows of the calibration tokens are read the same way (ranged reads of those rows
only: the embedding, 1 GB for a 128k x 4096 bf16 table, is never read whole).
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.algorithms import distributed
from lowbit.archs.experts import checkpoint_sources
from lowbit.io.st_format import CheckpointError, TensorReader, checkpoint_files
from lowbit.pipelines import moe_checkpoint as MC
# Bytes per ranged read; the reads of one layer run on READ_THREADS threads (a page-cache read
# is a memory copy by the kernel: several run at once; the GIL is released while they run).
READ_CHUNK = 32 << 20
READ_THREADS = 4


def read_threads() -> int:
    """Reader threads for this process: READ_THREADS, at most this host's usable cores shared out
    over the ranks on it (torchrun's LOCAL_WORLD_SIZE), at least 1: on a 4-core host two ranks'
    readers (8 threads) took the cores that the ranks' main threads need to launch kernels."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", distributed.world_size()))
    return max(1, min(READ_THREADS, cores // max(1, local)))


class Checkpoint:
    """Tensors of a (sharded) safetensors checkpoint by name: whole (get) or as byte spans
    (span) for ranged reads (read_into)."""

    def __init__(self, in_dir: Path):
        self.files = checkpoint_files(in_dir)   # validates every header first
        self._readers = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()           # the reader and the writer thread both read

    def _reader(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"the checkpoint has no tensor {name!r}, which config.json's model needs")
        path = self.files[name]
        with self._lock:
            if path not in self._readers:
                self._readers[path] = TensorReader(path)
            return self._readers[path]

    def get(self, name: str) -> torch.Tensor:
        r = self._reader(name)
        with self._lock:
            return r.get(name)

    def span(self, name: str) -> tuple[str, int, torch.dtype, list[int]]:
        """(file, absolute byte offset of the data, dtype, shape) of tensor `name`."""
        r = self._reader(name)
        dtype, shape = r.info(name)
        return r.path, r.span(name)[0], dtype, shape

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Fill `out` with the bytes of `path` from `offset` (positional reads: thread-safe)."""
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            fd = self._fds[path]
        got = 0
        while got < len(out):
            n = os.preadv(fd, [out[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"{path}: short read at byte {offset + got} ({got} of {len(out)} bytes)")
            got += n

    def close(self):
        for r in self._readers.values():
            r.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of parameter `param` (flattened), read by rank `owner` from `path` at
    byte `offset` (stored there as `fdtype`)."""
    param: str
    lo: int
    hi: int
    owner: int
    path: str
    offset: int
    fdtype: torch.dtype


def tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the loader fills of `module`: its parameters and its persistent buffers (those a
    checkpoint stores, e.g. DeepSeek-V3's router e_score_correction_bias), by name."""
    out = dict(module.named_parameters())
    for k, b in module.named_buffers():
        owner, _, leaf = k.rpartition(".")
        if leaf not in (module.get_submodule(owner) if owner else module)._non_persistent_buffers_set:
            out[k] = b
    return out


def model_sources(model: torch.nn.Module, ckpt: Checkpoint):
    """plan's `sources` for the layers of `model` (a transformers model, e.g. on the meta device)
    stored in `ckpt`: a tensor the checkpoint holds under the model's name is read by that name;
    a fused MoE experts weight (lowbit.archs.experts), which transformers 5 saves one tensor per
    expert and projection, from those tensors (checkpoint_sources: its conversion read
    backwards); any other tensor under the family's checkpoint name for its block (Mixtral's
    ``block_sparse_moe`` for ``mlp``: lowbit.pipelines.moe_checkpoint.renames). An experts weight
    found under neither layout raises CheckpointError naming the module and its family."""
    sites = MC.experts_sites(model)
    table = MC.renames(sites)

    def sources(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        if name in ckpt.files:
            return [(name, shape)]
        mod, _, attr = name.rpartition(".")
        site = sites.get(mod)
        if site is not None and attr in site.spec.weights:
            fam = site.spec.family
            try:
                srcs = checkpoint_sources(site.spec, site.ckpt, attr, shape)
            except ValueError as err:
                raise CheckpointError(f"{mod} ({fam} experts): {err}") from err
            missing = [n for n, _ in srcs or () if n not in ckpt.files]
            if srcs is None or missing:
                raise CheckpointError(
                    f"{mod} ({fam} experts): the checkpoint holds neither the fused {name} "
                    + ("" if srcs is None else f"nor the per-expert tensors of transformers' {fam} checkpoints "
                       f"({srcs[0][0]}, ...: {len(missing)} of {len(srcs)} missing, e.g. {missing[0]})")
                    + "; the layer loader cannot map this layout: load the model whole (quantize_model + "
                    "save_compressed) or convert the checkpoint with transformers' save_pretrained")
            return srcs
        return [(MC.rename(name, table), shape)]
    return sources


def plan(module: torch.nn.Module, prefix: str, ckpt: Checkpoint, world: int, sources=None) -> list[Piece]:
    """Every rank's pieces of `module`'s parameters and persistent buffers (the same list on
    every rank: the order of the broadcasts). sources(name, shape): the checkpoint tensors
    (name, shape) whose concatenation, each flattened, is the tensor `name` of the model
    (e.g. a fused MoE experts weight from its per-expert tensors: lowbit.archs.experts.
    checkpoint_sources); default: the tensor of that name alone. Raises when a checkpoint
    tensor's shape is not the one expected."""
    params, total = [], 0
    for k, p in tensors(module).items():
        srcs = [(prefix + k, tuple(p.shape))] if sources is None else sources(prefix + k, tuple(p.shape))
        if sum(math.prod(s) for _, s in srcs) != p.numel():
            raise ValueError(f"{prefix + k}: its checkpoint tensors {[n for n, _ in srcs][:3]} hold "
                             f"{sum(math.prod(s) for _, s in srcs)} elements, the parameter {p.numel()}")
        at = total
        for name, want in srcs:
            path, offset, fdtype, shape = ckpt.span(name)
            if tuple(shape) != tuple(want):
                raise ValueError(f"{name}: checkpoint shape {tuple(shape)}, config.json's model needs {tuple(want)}"
                                 + ("" if name == prefix + k else f" (a part of {prefix + k} {tuple(p.shape)})"))
            params.append((k, at, math.prod(want), path, offset, fdtype, at - total))
            at += math.prod(want)
        total = at
    pieces = []
    for r in range(world):
        lo, hi = distributed.share(total, world, r)
        for k, start, n, path, offset, fdtype, within in params:
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                esz = torch.empty((), dtype=fdtype).element_size()
                pieces.append(Piece(k, within + a - start, within + b - start, r, path,
                                    offset + (a - start) * esz, fdtype))
    return pieces


def read_pieces(pieces: list[Piece], ckpt: Checkpoint, dtype: torch.dtype, pool: ThreadPoolExecutor,
                pin_for=None, dtypes: dict[str, torch.dtype] | None = None
                ) -> tuple[list[tuple[Piece, torch.Tensor]], float]:
    """This rank's pieces on the host, each as a 1-D tensor of `dtype` (of dtypes[param] for the
    parameters it names, e.g. those transformers keeps in float32), and the seconds it took.
    The bytes go from the files straight into one staging buffer (page-locked when pin_for,
    a CUDA device, is given: run in a thread, which must select that device first, or CUDA
    would start a context on GPU 0 for it)."""
    t0 = time.time()
    if pin_for is not None:
        torch.cuda.set_device(pin_for)
    mine = [p for p in pieces if p.owner == distributed.rank()]
    sizes = [(p.hi - p.lo) * torch.empty((), dtype=p.fdtype).element_size() for p in mine]
    starts, at = [], 0
    for n in sizes:                    # each piece 64-byte aligned (a view as its dtype needs it)
        starts.append(at)
        at += -(-n // 64) * 64
    staging = torch.empty(at, dtype=torch.uint8, pin_memory=pin_for is not None)
    view = memoryview(staging.numpy()) if staging.numel() else memoryview(b"")
    jobs = []
    for p, n, s in zip(mine, sizes, starts):
        for c in range(0, n, READ_CHUNK):
            m = min(READ_CHUNK, n - c)
            jobs.append(pool.submit(ckpt.read_into, p.path, p.offset + c, view[s + c:s + c + m]))
    for j in jobs:
        j.result()
    out = []
    for p, n, s in zip(mine, sizes, starts):
        t = staging[s:s + n].view(p.fdtype)
        want = (dtypes or {}).get(p.param, dtype)
        if p.fdtype != want:           # cast on the host (IEEE round to nearest even, as on the device)
            t = t.to(want).pin_memory() if pin_for is not None else t.to(want)
        out.append((p, t))
    return out, time.time() - t0


def fill(module: torch.nn.Module, pieces: list[Piece], mine: list[tuple[Piece, torch.Tensor]]) -> None:
    """Write this rank's pieces into `module`'s (allocated) parameters and persistent buffers and broadcast every
    piece from its reader, in the order of `pieces` (a collective: every rank calls it)."""
    params = tensors(module)
    with torch.no_grad():
        for p, t in mine:
            flat = params[p.param].data.view(-1)
            flat[p.lo:p.hi].copy_(t, non_blocking=flat.is_cuda)
        if distributed.world_size() > 1:
            import torch.distributed as dist
            works = [dist.broadcast(params[p.param].data.view(-1)[p.lo:p.hi], src=p.owner, async_op=True)
                     for p in pieces]
            for w in works:
                w.wait()


def read_rows(ckpt: Checkpoint, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (sorted unique int64) of the 2-D checkpoint tensor `name`, [len(rows), cols],
    in its stored dtype: one ranged read per run of consecutive rows."""
    path, offset, fdtype, shape = ckpt.span(name)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D table, the checkpoint has shape {shape}")
    if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= shape[0]):
        raise ValueError(f"token ids must lie in [0, {shape[0]}) (the embedding's rows); got "
                         f"{int(rows[0])}..{int(rows[-1])}")
    row_bytes = shape[1] * torch.empty((), dtype=fdtype).element_size()
    out = torch.empty(rows.numel() * row_bytes, dtype=torch.uint8)
    view = memoryview(out.numpy()) if out.numel() else memoryview(b"")
    r = rows.tolist()
    i = 0
    while i < len(r):
        j = i
        while j + 1 < len(r) and r[j + 1] == r[j] + 1:
            j += 1
        ckpt.read_into(path, offset + r[i] * row_bytes, view[i * row_bytes:(j + 1) * row_bytes])
        i = j + 1
    return out.view(fdtype).reshape(len(r), shape[1])
