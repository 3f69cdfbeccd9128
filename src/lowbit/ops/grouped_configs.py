"""Launch configurations of the grouped MoE kernels (lowbit.ops.triton.grouped, grouped_w,
grouped_mx) as data: tiles, warps, pipeline stages and split-K per (kind, E, N, K, M).

M is the sorted buffer's rows (Routing.rows = tokens x top_k), the A operand's M; E the experts,
N x K one expert's weight. A config changes the speed only: every config gives outputs within the
same derived gate (the sums' grouping differs, the per-output rounding count does not exceed the
gate's; lowbit.ops.triton.grouped_w states the arithmetic), and the same bits on every run (split-K
sums its fp32 partials in a fixed order).

  grouped_default_config(kind, E, N, K, M)       the heuristic (vLLM fused_moe's shape: small
                                                 BLOCK_M for decode, 64-128 for prefill)
  grouped_candidates(kind, E, N, K, bucket)      <= 8 configs per cell for a tuner to time
  grouped_config(kind, E, N, K, M, weight)       what the launchers use: a registered table's
                                                 answer (register_grouped_table), else the GPU's
                                                 tuning table's cell, else the default; weight:
                                                 the 4-bit kinds' W4Format (the cell's key names it)
  check_config(kind, config, K, group)           the constraints, ValueError naming the fix
Each program finds its tile's expert and rows from the expert offsets and the BLOCK_M it was
compiled with (lowbit.ops.triton.grouped_schedule.tile_rows), so schedule and config always agree.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Callable

from lowbit.ops import tuning
from lowbit.ops.tuning import GROUPED_W4_KINDS, grouped_kind_key
from lowbit.ops.w4_formats import W4Format

KINDS = ("w4a16", "fp4", "w8a16", "int8", "fp8", "mxfp8")
WEIGHT_ONLY = ("w4a16", "fp4", "w8a16")      # weights decoded in the K loop (4 / 8-bit codes)
# Buckets of M (rows of the sorted buffer), the tuning table's keys: 1, 2-16, 17-64, 65-512, more
M_BUCKETS = ((1, 1), (2, 16), (17, 64), (65, 512), (513, 1 << 62))
PREFETCH_MAX_M = 32   # the 4-bit kernels' register prefetch spills above this BLOCK_M (sm_90 compile)


@dataclass(frozen=True)
class GroupedConfig:
    """One launch: BLOCK_M rows of one expert x BLOCK_N columns per program, BLOCK_K codes of K per
    loop step; Triton's num_warps / num_stages; split_k programs along K (fp32 partials, summed
    in a fixed order by a second pass); prefetch (the 4-bit kernels: 1 the next step's weights
    loaded into registers during the dots, 0 Triton's shared-memory pipeline, -1 the kernel's rule:
    prefetch at decode tiles). None of them changes the arithmetic."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    prefetch: int = -1

    def uses_prefetch(self) -> bool:
        """Whether a 4-bit launch prefetches into registers: the config's choice, else at BLOCK_M <= PREFETCH_MAX_M."""
        return self.block_m <= PREFETCH_MAX_M if self.prefetch < 0 else bool(self.prefetch)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GroupedConfig":
        return cls(**{k: int(v) for k, v in d.items()})


def m_bucket(M: int) -> int:
    """Index into M_BUCKETS of M sorted rows (M >= 1)."""
    for i, (lo, hi) in enumerate(M_BUCKETS):
        if lo <= M <= hi:
            return i
    raise ValueError(f"M = {M}: a grouped GEMM needs at least one row")


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_config(kind: str, c: GroupedConfig, K: int, group: int | None = None) -> None:
    """Raise ValueError naming the fix when `c` cannot run `kind` at this K / group size."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {KINDS}")
    if not all(_pow2(v) for v in (c.block_m, c.block_n, c.block_k)) or min(c.block_m, c.block_n) < 16:
        raise ValueError(f"{c}: block_m, block_n, block_k must be powers of two, block_m / block_n >= 16 "
                         "(tensor-core tiles)")
    if c.block_k < 32:
        raise ValueError(f"{c}: block_k >= 32 (4-bit weights split a step into two K halves of >= 16)")
    if c.num_warps not in (1, 2, 4, 8, 16) or not 1 <= c.num_stages <= 8 or c.split_k < 1:
        raise ValueError(f"{c}: num_warps in (1, 2, 4, 8, 16), 1 <= num_stages <= 8, split_k >= 1")
    if c.split_k > 1 and kind not in WEIGHT_ONLY:
        raise ValueError(f"{c}: split_k > 1 is for the weight-only kinds {WEIGHT_ONLY}; {kind} takes split_k = 1")
    if kind == "fp8" and c.block_k > 128:
        raise ValueError(f"{c}: fp8 partial sums are promoted every block_k <= 128 products")
    if c.prefetch not in (-1, 0, 1) or (c.prefetch == 1 and c.block_m > PREFETCH_MAX_M):
        raise ValueError(f"{c}: prefetch is -1 (the kernel's rule), 0 or 1, and 1 only at block_m <= "
                         f"{PREFETCH_MAX_M} (larger tiles spill the prefetched registers)")
    if group is not None and not _pow2(group):
        raise ValueError(f"group_size = {group}: the grouped kernels take power-of-two groups")


SMS = 132      # H100 / H200 multiprocessors


def _decode_split(kind: str, E: int, N: int, K: int, M: int, bn: int, bk: int) -> int:
    """Split-K for weight-only decode: the live programs (at most min(M, E) tiles x column blocks)
    stream all the weights, and the bytes in flight scale with their number, so double the split
    while there are fewer than 2 per SM and each split keeps >= 4 K steps (Mixtral's down
    projection at one token: 2 x 64 programs -> split 4)."""
    if kind not in WEIGHT_ONLY:
        return 1
    programs = min(M, E) * -(-N // bn)
    steps = -(-K // bk)
    split = 1
    while programs * split < 2 * SMS and steps // (2 * split) >= 4 and split < 8:
        split *= 2
    return split


@lru_cache(maxsize=4096)
def grouped_default_config(kind: str, E: int, N: int, K: int, M: int) -> GroupedConfig:
    """The heuristic config for M sorted rows over E experts (r = M / E rows per expert on average):
    BLOCK_M the power of two >= r between 16 and 128 (padding of an expert's last tile <= one tile);
    decode (r <= 16) BLOCK_N 64, BLOCK_K 128 (one int4 g128 group per step), 4 warps, split-K for
    the weight-only kinds when few programs are live (_decode_split); prefill
    64 x 128 tiles (one warp group of wgmma), W8A8 128 x 128 with 8 warps. Chosen from sm_90
    compiles (registers, no spills), not timed: the tuning table replaces it per GPU."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; choose one of {KINDS}")
    r = max(1, -(-M // max(E, 1)))
    bm = 16
    while bm < r and bm < 128:
        bm *= 2
    if bm <= 16:
        bn = 64 if N >= 64 else 32
        return GroupedConfig(16, bn, 128, 4, 4, _decode_split(kind, E, N, K, M, bn, 128))
    if bm <= 32:
        return GroupedConfig(32, 64, 64 if kind in WEIGHT_ONLY else 128, 4, 4)
    if bm <= 64 or kind in WEIGHT_ONLY:
        # weight-only at 128 rows: 128 x 128 tiles spill registers for int4 g32 (sm_90 compile)
        return GroupedConfig(64, 128, 64, 4, 3)
    return GroupedConfig(128, 128, 64, 8, 3)


def grouped_candidates(kind: str, E: int, N: int, K: int, bucket: int) -> list[GroupedConfig]:
    """<= 8 configs to time for one cell (bucket: index into M_BUCKETS), the default first.
    Decode buckets vary BLOCK_N / BLOCK_K / stages (weight streaming), for the 4-bit kinds the
    register prefetch (on by default; off: Triton's cp.async pipeline) and, for the weight-only
    kinds, split-K 2 / 4 (more programs when few experts are live); prefill buckets vary
    BLOCK_M / BLOCK_N / warps (tensor-core tile size)."""
    lo, hi = M_BUCKETS[bucket]
    rep = lo if hi - lo > 1024 else max(lo, min(hi, 2 * lo))
    rep = max(lo, min(hi, 4096 if bucket == len(M_BUCKETS) - 1 else rep))
    out = [grouped_default_config(kind, E, N, K, rep)]
    C = GroupedConfig
    wo = kind in WEIGHT_ONLY
    if bucket <= 1 and kind in GROUPED_W4_KINDS:      # the 4-bit kinds run _grouped_w4_kernel
        # the 4-bit decode tile without its register prefetch: Triton's cp.async pipeline streams the weights
        out.append(replace(out[0], prefetch=0))
    if bucket <= 1:
        more = [C(16, 32, 128, 4, 4), C(16, 128, 128, 4, 4), C(16, 64, 256, 4, 3), C(16, 64, 64, 4, 5),
                C(16, 64, 128, 4, 4, 2) if wo else C(16, 128, 256, 4, 3),
                C(16, 64, 128, 4, 4, 4) if wo else C(16, 64, 128, 2, 4),
                C(16, 128, 128, 8, 3)]
    elif bucket == 2:
        more = [C(16, 64, 128, 4, 4), C(32, 128, 128, 4, 3), C(64, 64, 128, 4, 3), C(32, 64, 64, 4, 4),
                C(32, 64, 128, 4, 4, 2) if wo else C(32, 128, 64, 4, 4), C(64, 128, 64, 4, 3), C(16, 128, 128, 4, 4)]
    elif wo:
        more = [C(64, 128, 64, 4, 4), C(64, 64, 64, 4, 3), C(128, 128, 64, 8, 3), C(128, 128, 128, 8, 3),
                C(64, 256, 64, 8, 3), C(32, 128, 128, 4, 3), C(64, 64, 128, 4, 3)]
    else:
        more = [C(64, 128, 64, 4, 3), C(64, 64, 128, 4, 4), C(128, 128, 64, 8, 3), C(128, 128, 128, 8, 3),
                C(128, 256, 64, 8, 3), C(64, 256, 64, 8, 3), C(128, 64, 128, 4, 3)]
    for c in more:
        if kind == "fp8" and c.block_k > 128:
            c = C(c.block_m, c.block_n, 128, c.num_warps, c.num_stages, c.split_k)
        if c not in out:
            out.append(c)
    return out[:8]


# A tuning table's lookup: (grouped_kind_key's key, N, K, M) -> GroupedConfig or None (not measured there).
_TABLE: list[Callable[[str, int, int, int], GroupedConfig | None]] = []


def register_grouped_table(lookup: Callable[[str, int, int, int], GroupedConfig | None] | None) -> None:
    """Make grouped_config ask `lookup` first (None: forget the table; the heuristic again)."""
    _TABLE.clear()
    if lookup is not None:
        _TABLE.append(lookup)


def grouped_config(kind: str, E: int, N: int, K: int, M: int, weight: W4Format | None = None) -> GroupedConfig:
    """The config a launcher runs when its caller gives none: the registered table's, else this
    GPU's tuning table's cell ("grouped", grouped_kind_key(kind, E, weight), N, K, bucket of M sorted
    rows; lowbit.ops.tuning), else the heuristic's (grouped_default_config). weight: the 4-bit kinds'
    weight format (required there: int4 g128 and g32, MXFP4 and NVFP4 have cells of their own)."""
    key = grouped_kind_key(kind, E, weight)
    if _TABLE:
        c = _TABLE[0](key, N, K, M)
        if c is not None:
            return c
    cfg = tuning.choose("grouped", key, N, K, M)[1]
    if cfg is not None:
        return GroupedConfig.from_dict(cfg)
    return grouped_default_config(kind, E, N, K, M)
