"""The per-GPU tuning table: which path each prepared layer kind runs at each batch size.

A quantized layer has more than one way to run on a GPU, and which is fastest depends on the GPU,
the shape and the number of rows M: lowbit's kernel (under one of a few tile configurations), or
the bf16 path (the weight dequantized into a reusable scratch buffer, then the bf16 GEMM -- at
large M the dequantization costs little against the GEMM). `lowbit tune` times every candidate on
the machine it runs on, at the shapes of a model, per M bucket, and writes a table; dispatch reads
it, so a cell where lowbit's kernel loses runs the alternative. Every candidate is one of the
layer's verified paths (each has its float64 reference test): the table changes speed, never which
quantized model runs.

A table is JSON:
    {"format": "lowbit-tune/1", "environment": {"gpu", "capability", "torch", "triton", "cuda"[, "driver"]},
     "cells": [{"op": "linear", "kind": "w4a16/int4/g128", "N": 6144, "K": 4096, "bucket": "1",
                "path": "kernel", "config": {...} | null, "ratio": 1.37, "us": {"bf16": .., ...}}]}
Which table is read: the file named by the environment variable LOWBIT_TUNE_TABLE, else the table
shipped for this GPU (lowbit/ops/tables/<gpu>.json). A table measured on another GPU, or under
another torch / triton / CUDA version or NVIDIA driver (where it records one), is refused with the reason
(`lowbit doctor` prints it) and
the heuristic below decides instead. Cells are exact (kind, N, K, bucket); a shape the table did
not measure also takes the heuristic. A grouped cell whose kind is not grouped_kind_key's spelling
(a 4-bit kind without its weight format, as older tables wrote them) is refused on reading, with the
reason in active()'s line; the rest of the table applies.
"""
from __future__ import annotations

import ctypes
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from lowbit.ops.w4_formats import W4Format

FORMAT = "lowbit-tune/1"
# (lowest M, highest M or None, name): decode, small batches, medium, prefill chunks, long prefill
BUCKETS = ((1, 1, "1"), (2, 16, "2-16"), (17, 64, "17-64"), (65, 512, "65-512"), (513, None, "513+"))
BUCKET_NAMES = tuple(b[2] for b in BUCKETS)
# the M each bucket is timed at by `lowbit tune`
BUCKET_M = {"1": 1, "2-16": 16, "17-64": 64, "65-512": 256, "513+": 2048}
# "triton": a W8A8 native cell's answer (op "native"): the layer's Triton class runs, as its own linear cell says
# (a weight-only native layer holds no Triton layout and reads it as "dequant")
# "scaled_mm" / "cutlass": the fp8 W8A8 class's prefill paths (torch._scaled_mm row-wise, lowbit's CUTLASS GEMM)
PATHS = ("kernel", "dequant", "triton", "scaled_mm", "cutlass")
ENV_KEYS = ("gpu", "capability", "torch", "triton", "cuda")
# recorded by `lowbit tune` where it can be read, and checked where both the table and this machine have it
# (a table written before it was recorded, as the shipped H200 one, is not checked for it)
OPTIONAL_ENV_KEYS = ("driver",)
TABLES_DIR = Path(__file__).with_name("tables")


def bucket(M: int) -> str:
    """The bucket name of M rows (M >= 1)."""
    for lo, hi, name in BUCKETS:
        if hi is None or M <= hi:
            return name
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Cell:
    op: str            # "linear"
    kind: str          # kind_key of the prepared layer; grouped: grouped_kind_key
    N: int
    K: int
    bucket: str
    path: str          # "kernel" | "dequant"
    config: dict | None = None   # the kernel's tile configuration (None: its default)
    ratio: float | None = None   # bf16 time / this path's time, as measured
    us: dict = field(default_factory=dict)  # candidate -> microseconds (GPU time, CUDA graph replay)

    def to_dict(self) -> dict:
        return dict(op=self.op, kind=self.kind, N=self.N, K=self.K, bucket=self.bucket, path=self.path,
                    config=self.config, ratio=self.ratio, us=self.us)


@dataclass
class Table:
    environment: dict
    cells: dict  # (op, kind, N, K, bucket) -> Cell
    refused: dict = field(default_factory=dict)  # kind of each refused cell -> why (table_from_dict)

    def lookup(self, op: str, kind: str, N: int, K: int, M: int) -> Cell | None:
        return self.cells.get((op, kind, N, K, bucket(M)))

    def to_dict(self) -> dict:
        return dict(format=FORMAT, environment=self.environment,
                    cells=[c.to_dict() for c in self.cells.values()])


def environment() -> dict:
    """This machine's facts a table depends on (None for each where there is no GPU / triton)."""
    import torch

    env = dict.fromkeys(ENV_KEYS)
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        env["capability"] = f"{major}.{minor}"
        driver = driver_version()
        if driver is not None:
            env["driver"] = driver
    return env


@functools.lru_cache(maxsize=1)
def driver_version() -> str | None:
    """The NVIDIA driver's version ("580.65.06"), read through NVML once per process (`lowbit tune` builds a
    table around every candidate it times), or None where NVML cannot say."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        return None
    return buf.value.decode() if ok else None


def table_from_dict(d: dict, source: str = "table") -> Table:
    """A validated Table; ValueError naming what is wrong (nothing half-read is returned)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{source}: not a lowbit tuning table (want \"format\": \"{FORMAT}\"); "
                         "make one with `lowbit tune`")
    env = d.get("environment")
    if not isinstance(env, dict) or any(k not in env for k in ENV_KEYS):
        raise ValueError(f"{source}: \"environment\" must name {', '.join(ENV_KEYS)}")
    cells, refused = {}, {}
    for i, c in enumerate(d.get("cells") or []):
        try:
            cell = Cell(op=str(c["op"]), kind=str(c["kind"]), N=int(c["N"]), K=int(c["K"]), bucket=str(c["bucket"]),
                        path=str(c["path"]), config=c.get("config"), ratio=c.get("ratio"), us=dict(c.get("us") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: cell {i} is malformed ({err}); re-run `lowbit tune`") from None
        if cell.bucket not in BUCKET_NAMES or cell.path not in PATHS:
            raise ValueError(f"{source}: cell {i} has bucket {cell.bucket!r} / path {cell.path!r}; buckets are "
                             f"{BUCKET_NAMES}, paths {PATHS}")
        if cell.config is not None and not isinstance(cell.config, dict):
            raise ValueError(f"{source}: cell {i}'s config must be an object or null")
        why = grouped_key_refusal(cell.kind) if cell.op == "grouped" else None
        if why is not None:         # no lookup asks for it: kept out, and said so
            refused[cell.kind] = why
            continue
        cells[(cell.op, cell.kind, cell.N, cell.K, cell.bucket)] = cell
    return Table(env, cells, refused)


def load_table(path: str | os.PathLike) -> Table:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise ValueError(f"tuning table {p}: cannot read it ({err.strerror or err})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"tuning table {p}: not JSON ({err})") from None
    return table_from_dict(d, f"tuning table {p}")


def save_table(table: Table, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(table.to_dict(), indent=1) + "\n")


def mismatch(table_env: dict, env: dict) -> str | None:
    """Why a table measured under `table_env` does not apply here (None: it does). The GPU, its
    capability, the versions of torch, triton and CUDA, and the driver (where both record it) all change
    which kernel is fastest."""
    diffs = [f"{k} {table_env.get(k)!r} (here {env.get(k)!r})" for k in ENV_KEYS if table_env.get(k) != env.get(k)]
    diffs += [f"{k} {table_env[k]!r} (here {env[k]!r})" for k in OPTIONAL_ENV_KEYS
              if table_env.get(k) is not None and env.get(k) is not None and table_env[k] != env[k]]
    if not diffs:
        return None
    return "measured with another " + ", ".join(diffs)


def shipped_path(gpu: str | None) -> Path | None:
    if not gpu:
        return None
    return TABLES_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json")


_STATE: dict = {}


def active() -> tuple[Table | None, str]:
    """(the table dispatch reads, or None; one line saying which and why). Read once per process
    (`reset()` reads again)."""
    if "table" not in _STATE:
        _STATE["table"], _STATE["why"] = _find()
    return _STATE["table"], _STATE["why"]


def reset(table: Table | None = None, why: str | None = None) -> None:
    """Forget the table read (or install `table`: tests, `lowbit tune`), and every cached choice."""
    _STATE.clear()
    if table is not None or why is not None:
        _STATE["table"], _STATE["why"] = table, why or "installed by the caller"
    clear_choices()


_PER_TABLE: list = []


def per_table(fn):
    """`fn` cached for as long as the table read and the kernels registered stay: reset() and
    clear_choices() (called when a kernel class is registered) forget its answers."""
    cached = functools.lru_cache(maxsize=8192)(fn)
    _PER_TABLE.append(cached)
    return cached


def clear_choices() -> None:
    """Forget every cached choice (the table itself stays read)."""
    for cached in _PER_TABLE:
        cached.cache_clear()


def _find() -> tuple[Table | None, str]:
    env = environment()
    given = os.environ.get("LOWBIT_TUNE_TABLE")
    if given:
        path = Path(given)
    else:
        path = shipped_path(env["gpu"])
        if path is None:
            return None, "no CUDA GPU: the CPU paths run"
        if not path.exists():
            return None, (f"no tuning table for {env['gpu']}: the heuristic decides (run `lowbit tune` and set "
                          "LOWBIT_TUNE_TABLE to its output)")
    try:
        table = load_table(path)
    except ValueError as err:
        return None, f"{err}: the heuristic decides"
    why = mismatch(table.environment, env)
    if why is not None:
        return None, f"tuning table {path} refused, {why}: the heuristic decides (re-run `lowbit tune`)"
    if table.refused:
        kind, reason = next(iter(table.refused.items()))
        return table, (f"tuning table {path} ({len(table.cells)} cells; grouped cells of {len(table.refused)} "
                       f"kind(s) refused, e.g. {kind!r}: {reason}: the heuristic decides those, re-run "
                       "`lowbit tune --moe`)")
    return table, f"tuning table {path} ({len(table.cells)} cells)"


@functools.lru_cache(maxsize=None)
def kind_key(spec) -> str:
    """The table's name for a prepared layer kind (lowbit.ops.prepared.Spec)."""
    if spec.kind in ("w4a16", "fp4"):
        return f"{spec.kind}/{spec.w4kind}/g{spec.group}"
    if spec.kind == "w8a8":
        return f"w8a8/{spec.act_mode}"
    return spec.kind


# grouped (MoE) kinds whose experts' weights come in several 4-bit formats (int4 per group, with or
# without zero points, MXFP4, NVFP4): different kernels in speed and best tiles, so their keys name
# the format. The 8-bit kinds (w8a16, int8, fp8, mxfp8) have one weight format each.
GROUPED_W4_KINDS = ("w4a16", "fp4")


def grouped_kind_key(kind: str, E: int, weight: W4Format | None = None) -> str:
    """The table's name for a grouped kernel kind over E experts: "<kind>/<weight format>/E<E>" for
    the 4-bit kinds (weight.key: "w4a16/int4/g128/E8", "w4a16/int4/g32/zp/E8", "fp4/nvfp4/g16/E8",
    spelled as the dense "w4a16/int4/g128"), "<kind>/E<E>" for the 8-bit ones ("int8/E8")."""
    if (kind in GROUPED_W4_KINDS) != (weight is not None):
        raise ValueError(f"grouped kind {kind!r} with weight={weight}: the kinds {GROUPED_W4_KINDS} take their "
                         "4-bit weight format (a W4Format), the 8-bit kinds none")
    return f"{kind}/{weight.key}/E{E}" if weight is not None else f"{kind}/E{E}"


def grouped_key_refusal(key: str) -> str | None:
    """Why a grouped cell's kind is not a key grouped_kind_key makes (None: it is one). A 4-bit kind
    without a weight format ("w4a16/E8", as tables before the formats were told apart wrote them)
    would stand for every format at once: it is refused, never applied to all of them."""
    head, _, experts = key.rpartition("/")
    kind, _, fmt = head.partition("/")
    if not kind or not re.fullmatch(r"E[1-9][0-9]*", experts):
        return "not a grouped key ('<kind>[/<weight format>]/E<experts>')"
    if kind not in GROUPED_W4_KINDS:
        return None if not fmt else f"{fmt!r}: {kind!r} has one weight format, its key names none"
    if not fmt:
        return (f"names no weight format, so it would stand for every 4-bit weight format {kind} runs (int4 "
                "g128 / g32 / zero points, MXFP4, NVFP4: different kernels' speed and tiles)")
    if W4Format.from_key(fmt) is None:
        return f"unknown weight format {fmt!r} (e.g. int4/g128, int4/g32/zp, mxfp4/g32, nvfp4/g16)"
    return None


def heuristic(kind: str, M: int, op: str = "linear") -> str:
    """The path without a table cell. Weight-only kernels read 2-4x fewer weight bytes and win
    while reading weights dominates (decode, small batches); from 65 rows on (the point where the
    H200's measurements turned) the bf16 GEMM on the dequantized weight is preferred, the safe
    choice on an unmeasured GPU. W8A8 has 8-bit tensor cores at every M: its kernel.
    Grouped experts (op "grouped", M the sorted rows, tokens x top_k): grouped_heuristic. An opted-in
    native class (op "native") as the kind's Linear: the weight-only GEMV up to 64 rows (16 a launch), then
    the dequant path; W8A8's decode kernel where it takes the call (its class checks the rows)."""
    if op == "grouped":
        return grouped_heuristic(kind, M)
    if kind.startswith(("w4a16", "w8a16", "fp4", "mxfp8")):
        return "kernel" if M <= 64 else "dequant"
    return "kernel"


GROUPED_BF16_KINDS = ("w4a16", "fp4", "w8a16")      # grouped kinds with a bf16 (dequant) path
GROUPED_DEQUANT_FROM = 65                            # sorted rows: the first prefill bucket (65-512)


def grouped_heuristic(kind: str, M: int) -> str:
    """The grouped path without a table cell (kind: grouped_kind_key's, "<kind>[/<weight format>]/E<E>").
    The weight-only grouped kernels (W4A16, fp4, W8A16) decode every weight in the tile's K loop at
    fixed small tiles: on the H200 the W4A16 kernel took 22.6 ms for Mixtral-8x7B's gate_up at 4096
    sorted rows (the int8 kernel 1.27 ms) and two Mixtral layers of W4A16 prefill ran at 0.01x the
    grouped bf16 GEMM. So from GROUPED_DEQUANT_FROM sorted rows on (the prefill buckets, as for
    dense layers) their weights are dequantized into the scratch buffer and torch._grouped_mm runs
    them. Below (decode) the kernel stays: the bf16 path writes and re-reads each used expert's
    bf16 weight per call, ~9x the 4-bit kernel's weight bytes, and it is not measured there yet
    (`lowbit tune` times both). The W8A8 kinds keep their kernels (no bf16 path)."""
    if kind.partition("/")[0] in GROUPED_BF16_KINDS and M >= GROUPED_DEQUANT_FROM:
        return "dequant"
    return "kernel"


@per_table
def choose(op: str, kind: str, N: int, K: int, M: int) -> tuple[str, MappingProxyType | None]:
    """(path, kernel configuration or None) for a layer kind, shape and M; cached per process. The
    configuration is a read-only view of the cell's (callers copy it to change it)."""
    table, _ = active()
    cell = None if table is None else table.lookup(op, kind, N, K, M)
    if cell is None:
        return heuristic(kind, M, op), None
    return cell.path, None if cell.config is None else MappingProxyType(cell.config)
