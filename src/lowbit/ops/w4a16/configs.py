"""Launch configurations of the W4A16 kernels: kernel choice, tiles and split-K per weight
layout and M (no run-time autotuning, so compile time stays bounded). The reasons are sm_90
SASS counts and timings on the H200 (docs/benchmarks-memory.md; `python -m lowbit.bench.memory
--only w4a16` times them)."""
from __future__ import annotations

SMS = 132  # H100 / H200 multiprocessors: the split-K heuristic aims at >= 2 programs per SM

# The interpreter's launches split K only when this is True (tests set it): each then takes the
# split the GPU's configuration gives for the same shape, so the GPU's split-K paths (workspace,
# reduction, their plan-recordability) run on the CPU; by default the interpreter never splits
# (fewer programs, each run in Python).
GPU_SPLIT_IN_INTERPRETER = False


def _interp_split(gpu_config, steps: int) -> int:
    """The split-K factor of an interpreter launch: 1, or under GPU_SPLIT_IN_INTERPRETER the GPU's
    (`gpu_config()["split"]`, a power of two) halved until it divides the interpreter's K steps."""
    if not GPU_SPLIT_IN_INTERPRETER:
        return 1
    split = gpu_config()["split"]
    while steps % split:
        split //= 2
    return split


def split_k(programs: int, steps: int, target: int) -> int:
    """Split-K factor for the W4A16 heuristics: double it while there are fewer than `target`
    programs and each split keeps at least 2 K steps of an even division."""
    split = 1
    while programs * split < target and steps % (2 * split) == 0 and steps // (2 * split) >= 2:
        split *= 2
    return split


def pick_config_planar8(M: int, N: int, K: int, group: int, *, interpret: bool = False,
                        kernel: str | None = None) -> dict:
    """Kernel and tiles for a planar8 weight (reasoned from sm_90 SASS counts, not tuned by
    timing): "gemv8" for M <= 4 (or groups below 128), else "dot8" -- the tensor-core
    form on the same layout: BLOCK_N 128, BLOCK_K 256, 4 warps, 16 / 32 / 64 rows (K loop
    ~4.1-4.5 SASS instructions per weight against ~7.6 for the planar_chunks "dot" kernel at
    16 rows), split-K until one program per SM (N = 8192, 16 rows: 64 blocks x split 4)."""
    if kernel == "gemv8" or (kernel is None and (M <= 4 or group < 128)):
        return pick_config_gemv8(M, N, K, group, interpret=interpret)
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 16 if interpret else 128
    bk = group if interpret else max(256, group)
    while K % bk:
        bk //= 2
    steps = K // bk
    split = (_interp_split(lambda: pick_config_planar8(M, N, K, group, kernel=kernel), steps) if interpret
             else split_k(-(-N // bn) * -(-M // bm), steps, SMS))
    # unpack 1 (packed bf16/fp16 pairs, inline PTX: ~3.3 instead of ~4.1 SASS instructions per
    # weight at 16 rows) is opt-in: it has not been checked on a GPU
    return {"kernel": "dot8", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 1, "unpack": 0}


def pick_config_gemv8(M: int, N: int, K: int, group: int, *, interpret: bool = False) -> dict:
    """Tiles and split-K of the "gemv8" kernel (planar8 layout; reasoned from sm_90 SASS, not
    tuned by timing). BLOCK_N 128 with 4 warps: each thread holds 4 rows x 4 words (16-byte
    loads, 32 codes per row per group of 128), so every x value it loads serves 4 rows.
    BLOCK_K 512 codes per loop step at one row of x (4 groups of 128: 4 independent 16-byte
    loads per row in flight per thread; 128 registers, sm_90 compile), 256 at 2 rows, 128 at
    4 rows (255 registers; 512 spills). Split-K until there are >= 2 programs per SM (N =
    8192: 64 column blocks x split 4), keeping >= 2 loop steps per program. Up to 4 rows of x
    per program: each further block of 4 rows unpacks the weights again (read from L2), so
    this kernel is for M = 1..4; the tensor-core form is the one for larger M."""
    bm = 1 if M == 1 else (2 if M == 2 else 4)
    bn = 16 if interpret else 128
    bk_max = group if interpret else max(512 // bm, group)
    bk = group
    while bk * 2 <= bk_max and K % (bk * 2) == 0:
        bk *= 2
    steps = K // bk
    split = (_interp_split(lambda: pick_config_gemv8(M, N, K, group), steps) if interpret
             else split_k(-(-N // bn) * -(-M // bm), steps, 2 * SMS))
    return {"kernel": "gemv8", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 1}


def pick_config_pairs(M: int, N: int, K: int, group: int, *, kind: str = "int4", interpret: bool = False) -> dict:
    """Tiles of the "pairs" kernel (lowbit.ops.triton.w4a16.pairs), from sm_90 SASS counts (2.3 /
    2.7 / 3.2 instructions per weight in the K loop at 1 / 16 / 64 rows) and timings on the H200:
    BLOCK_M = M rounded up to a power of two (1..8: mma v2, x padded to 8 columns; 16..64:
    wgmma), BLOCK_N 128 (64 at 16 rows) with 4 warps (the row relabelling assumes BLOCK_N %
    (16 * warps) == 0),
    BLOCK_K 256 codes (two chunks; the next step's words are loaded while this one computes),
    128 at 64 rows except for NVFP4;
    split-K by K (below); per-kind register caps and tiles (below; `scripts/gpu.sh w4configs`
    times the alternatives); xpf: the next step's x prefetched into L1 (_prefetch_l1).
    kind: the weight's format, W4Weight.kind ("int4", "uint4", "mxfp4", "nvfp4")."""
    bm = 1
    while bm < min(M, 64):
        bm *= 2
    warps = 1 if interpret else 4
    # BLOCK_N 64 at 16 rows: ~7% faster than 128 there; at 1 and 64 rows 128 is the best or within 1%
    bn = 16 if interpret else (64 if bm == 16 else 128)
    # 64 rows: one chunk per step for integer weights (two spill: 255 registers, local loads in the
    # sm_90 K loop); NVFP4's folded scales leave room for two, 8-13% faster than one
    bk = 128 if interpret or K % 256 or (bm >= 64 and kind != "nvfp4") else 256
    steps = K // bk
    split = _interp_split(lambda: pick_config_pairs(M, N, K, group, kind=kind), steps) if interpret else 1
    if not interpret:
        # split-K: ~2048 codes of K per program (split 4 at K = 8192 is the fastest or within 2% at
        # 1, 16 and 64 rows; the 8-16 a programs-per-SM rule gives is 1.1-1.6x slower at 16 / 64
        # rows), then more only while there are fewer programs than SMs
        while 2 * split * 2048 <= K and steps % (2 * split) == 0:
            split *= 2
        split = max(split, split_k(-(-N // bn) * -(-M // bm) * split, steps // split, SMS) * split)
    # wgmma tiles (16+ rows): Triton's 2-stage pipelining on top (1.4-1.8x faster than one stage)
    # groups below 128 codes (two to four scale tiles per step): a register cap (168 at one row,
    # 128 at 16) lets ptxas keep more programs per SM, 5-30% faster; at g128 it does not help
    maxnreg = 0
    if group < 128 and kind in ("int4", "uint4") and not interpret:
        maxnreg = {1: 168, 16: 128}.get(bm, 0)
    # the next step's x prefetched into L1 (_prefetch_l1) at 64 rows only (16-32 KB of x per step:
    # up to 10% faster for int4 g128 and MXFP4); with one or a few 128-byte lines of x per step
    # (1 and 16 rows), for NVFP4 and for int4 g32 it is no faster or slower
    xpf = int(bm >= 64 and kind != "nvfp4" and (group >= 128 or kind == "mxfp4") and not interpret)
    return {"kernel": "pairs", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "split": split,
            "num_warps": warps, "num_stages": 2 if bm >= 16 and not interpret else 1,
            "maxnreg": maxnreg, "xpf": xpf}


def pick_config(M: int, N: int, K: int, kind: str, group: int, chunk: int, *, interpret: bool = False) -> dict:
    """Kernel choice, tiles and split-K (H100/H200, 132 SMs).

    From timings on the H200 (int4 g128, N = 8192 and 28672, K = 8192): at M = 1 and 16 every
    tensor-core configuration with BLOCK_N 32 or 64 ran within ~5% of the best (dot, BLOCK_N 32, no split)
    and the GEMV form was 1.5-3x slower, so the dot form is used for every M; BLOCK_N 32 up to 16
    rows, 64 above. BLOCK_K holds several chunks (512 codes at 16 rows, 256 at 32/64 rows, whose
    pipelined buffers must fit shared memory: 512 at 64 rows needed 237568 > 232448 bytes). Split-K
    only when there are fewer programs than SMs. kernel="gemv" (float32 FMAs, M <= 2) stays
    available through `config`."""
    bm = 16 if M <= 16 else (32 if M <= 32 else 64)
    bn = 16 if interpret else (32 if M <= 16 else 64)
    bk_max = chunk if interpret else (512 if bm <= 16 else 256)
    if chunk < 128 and bm >= 32 and not interpret:
        # small groups at 32 / 64 rows: BLOCK_K 256 needs 255 registers and spilled at 64 rows
        # (sm_90 SASS: 18.8 instructions per weight with local loads/stores in the K loop, 0.1x
        # the speed of bf16); 128 takes 195 registers, no spills, 14.6
        bk_max = 128
    bk = chunk
    while bk * 2 <= bk_max and K % (bk * 2) == 0:
        bk *= 2
    steps = K // bk
    split = (_interp_split(lambda: pick_config(M, N, K, kind, group, chunk), steps) if interpret
             else split_k(-(-N // bn) * -(-M // bm), steps, SMS))
    return {"kernel": "dot", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "split": split, "num_warps": 4, "num_stages": 3 if bm <= 16 else 2}




# (BLOCK_N, chunks of 128 codes per program, num_warps) of the pairs dequantization on the GPU:
# (128, 1, 4) is the fastest for int4 g128 and NVFP4 at 14336 x 4096 and 4096 x 14336 (up to
# 1.2x faster than (64, 1, 4)); every configuration gives the same bits
PAIRS_DEQUANT = (128, 1, 4)
PAIRS_DEQUANT_INTERP = (16, 1, 4)  # in Triton's interpreter (small tiles: every program runs in Python)
