"""Which fused-quantizer kernel runs and with which tile (lowbit.ops.fused's `kernel=` and
`tile=`): DEFAULT_KERNEL per entry point and scheme kind, the "tile" kernel's (ROWS, num_warps)
per hidden size, and the row kernel's warps. Every choice gives the same codes; these only set
the speed (benchmarks/results/bench-memory.json, docs/benchmarks-memory.md)."""
from __future__ import annotations

from lowbit.scheme import QuantScheme

# Kernel variants: "row" = one row per program, any scheme; "tile" = ROWS rows per program
# (a per-token int8 / fp8 fast path and a group variant), 32-64 elements per thread. Same
# arithmetic, same codes. DEFAULT_KERNEL (what kernel=None picks) takes the faster one per entry
# point on the H200 (benchmarks/results/bench-memory.json): "tile" for quantize_rows and RMSNorm
# without a residual; "row" for RMSNorm with a residual (the tile kernel is no faster there) and
# for SiLU-mul (the tile kernel is slower for fp8).
KERNELS = ("row", "tile")
DEFAULT_KERNEL = {"quantize_rows": "tile", "rmsnorm_quant": "tile", "rmsnorm_quant+residual": "row",
                  "silu_mul_quant": "row"}
# Schemes outside the per-token fast path (groups, MX, NVFP4, fp4 per token): ":group" entries
# choose between the row kernel and the tile kernel's group variant, which is 1.0-1.5x the row
# kernel for quantize_rows and RMSNorm (bench-memory.json); with a residual and for SiLU-mul the
# group variant is untimed, so those stay "row".
DEFAULT_KERNEL.update({k + ":group": "row" for k in list(DEFAULT_KERNEL)})
DEFAULT_KERNEL.update({"quantize_rows:group": "tile", "rmsnorm_quant:group": "tile"})


def row_warps(block: int) -> int:
    """num_warps of a kernel holding one row of `block` elements in registers (row quantizer, qdq_rows)."""
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def tile_supports(scheme: QuantScheme) -> bool:
    """Whether the "tile" kernel's per-token fast path (_token_tile_kernel) takes `scheme`:
    per-token / per-channel, int8 or fp8_e4m3fn, fp32 scale. Every other scheme the fused
    quantizer takes goes to its group kernel (_group_tile_kernel) under kernel="tile"."""
    return (scheme.strategy in ("token", "channel") and scheme.format in ("int8", "fp8_e4m3fn")
            and scheme.scale_format == "fp32")


def tile_config(K: int, pre: int, residual: bool = False, fp8: bool = False, mx: bool = False) -> tuple[int, ...]:
    """(ROWS, num_warps) of the "tile" kernel for rows of K elements: 32 elements of a row per
    thread (num_warps = next_pow2(K) / 1024, at most 16; 64 per thread from 8192 on), and rows stacked up to 32 elements per
    thread when a row is shorter than 1024. 64 per thread takes fewer instructions per element
    (python -m lowbit.bench.memory --sass) but about twice the registers (half the warps per SM);
    the benchmark times both side by side (`pre` is unused so far).
    With a `residual`, at least 2 rows per program (one row gave non-canonical scales on sm_90).
    fp8 (per-token fp8_e4m3fn on the token fast path), no residual, K >= 8192: (ROWS, num_warps, 2),
    the persistent form with 2 programs per SM, which moves more of copy bandwidth there than one
    program per tile (for int8, and at K = 4096, it is slower; bench-memory.json).
    mx (the group kernel with e8m0 scales, MXFP4 / MXFP8), no residual: 64 per thread from 4096 on."""
    import triton

    block = max(16, triton.next_power_of_2(K))
    # 64 elements per thread from K = 8192 (at 4096, 32 per thread reaches more of copy bandwidth),
    # and from 4096 for MX group scales without a residual (not NVFP4: slower there); the rows are
    # in benchmarks/results/bench-memory.json
    wide = block >= 8192 or (mx and not residual and block >= 4096)
    warps = min(16, max(1, block // (2048 if wide else 1024)))
    rows = 1
    while rows * block < 32 * 32 * warps and rows < 8:
        rows *= 2
    if (rows, warps) == (1, 1) or (residual and rows == 1):  # refused in launch_tile (non-canonical
        rows = 2                                                # scales seen on sm_90)
    if fp8 and not residual and block >= 8192:
        return rows, warps, 2
    return rows, warps


def default_tile(scheme: QuantScheme, K: int, pre: int, residual: bool = False) -> tuple[int, ...]:
    """The tile the "tile" kernel takes for `scheme` when none is given: tile_config with the
    scheme's flags (fp8 on the per-token fast path; mx for e8m0 group scales)."""
    return tile_config(K, pre, residual=residual, fp8=tile_supports(scheme) and scheme.format == "fp8_e4m3fn",
                       mx=scheme.scale_format == "e8m0")


def resolve_kernel(kernel: str | None, scheme: QuantScheme, where: str, variant: str = "",
                   pack: bool = False) -> str:
    """The kernel an entry point runs: `kernel`, or DEFAULT_KERNEL[where + variant] for None
    (group-scaled schemes: DEFAULT_KERNEL[where + ":group"]). pack=True needs "tile" (the
    kernel that writes two fp4 codes per byte)."""
    if kernel is None:
        if pack:
            return "tile"
        return DEFAULT_KERNEL[where + variant + ("" if tile_supports(scheme) else ":group")]
    if kernel not in KERNELS:
        raise ValueError(f"{where}: kernel must be one of {KERNELS} or None (default "
                         f"{DEFAULT_KERNEL[where + variant]!r}), got {kernel!r}")
    if pack and kernel != "tile":
        raise ValueError(f"{where}: pack=True writes two fp4 codes per byte, which only kernel='tile' does; "
                         f"pass kernel='tile' or kernel=None, not {kernel!r}")
    return kernel
