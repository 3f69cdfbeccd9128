"""Helpers shared by lowbit's Triton kernels: exact rounding primitives that behave the same
on the GPU and in Triton's CPU interpreter, argument checks that run before any launch, and
the per-shape launch configurations.

Why not `libdevice.rint` / `.to(tl.float8e4nv)`: Triton 3.6's interpreter implements neither
faithfully (libdevice is not available there, and its fp32->fp8 cast rounds half up and does
not produce subnormals), so CI could not check the kernels' rounding. The helpers below use
only IEEE-exact fp32 operations (add, multiply by powers of two, bit casts), which both the
interpreter and the GPU evaluate identically.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lowbit.ops.bound import note_launch, note_slow_launch

# 1.5 * 2**23: adding it to |v| < 2**22 in fp32 leaves no fraction bits, so the fp32 add
# rounds v to an integer with the hardware's round-half-even; subtracting restores the range.
_RINT_MAGIC = 12582912.0


@triton.jit
def rint(v):
    """Round-half-even to an integer-valued fp32, exact for |v| < 2**22 (callers clamp first)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def nonzero_quotient(a, d):
    """a / d by IEEE division, 1.0 where that is 0: a scale from a range (amax / qmax), so an all-zero range
    gives scale 1 and codes 0, never a NaN."""
    q = tl.math.div_rn(a, d)
    return tl.where(q == 0.0, 1.0, q)


@triton.jit
def encode_e4m3fn(v):
    """fp32 -> fp8 e4m3fn bit pattern (uint8), round-half-even, saturating to +-448.

    Same result as `lowbit.encode(v, 'fp8_e4m3fn', saturate=True)` for finite v. The value is
    snapped to the e4m3 grid with exact fp32 arithmetic: the grid step at |v| is
    2**(max(e, -6) - 3) (3 mantissa bits, normals from 2**-6, subnormal step 2**-9), and
    |v| / step < 2**5, so `rint` is exact. The magnitude code is then (e + 6) * 8 + m, which
    also covers subnormals (e = -6, m < 8) and a round-up into the next binade (m = 16).
    """
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    inv_step = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e), exact
    m = rint(a * inv_step).to(tl.int32)
    mag = (e + 6) * 8 + m
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (mag | sign).to(tl.uint8)


@triton.jit
def decode_e4m3fn(c):
    """fp8 e4m3fn bit pattern (int32) -> float32, exact (NaN codes are never produced): the seven
    magnitude bits placed at fp16 bits 13..7 (exponent field = e, mantissa = m's three bits)
    make the fp16 number 2^(e-15) (1 + m/8) for e > 0 and 2^-14 m/8 (subnormal) for e = 0 --
    the e4m3 value 2^(e-7) (1 + m/8) resp. 2^-6 m/8 times 2^-8 in both cases; the sign goes to
    bit 15. fp16 -> float32 is exact (subnormals included) and so is the product by 2^8: five
    integer / conversion operations instead of a select between two decodings."""
    h = ((c & 127) << 7) | ((c & 128) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def decode_e8m0(c):
    """e8m0 code (uint8) -> fp32 power of two 2**(c - 127); code 0 is 2**-127 (fp32 subnormal)."""
    ci = c.to(tl.int32)
    bits = tl.where(ci == 0, 0x00400000, ci << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_out(y, out_ty: tl.constexpr):
    """fp32 tile -> the output dtype, round-to-nearest-even on the GPU and in the interpreter
    alike (the interpreter's own fp32 -> bf16 cast truncates): for bf16 the RNE step is done on
    the bits first (add 0x7FFF plus the lowest kept bit, clear the low half), so the cast is exact."""
    if out_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = bits.to(tl.float32, bitcast=True)
    return y.to(out_ty)


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (CI, tests without CUDA)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------- launching with little host time

_LAUNCH_CACHE: dict = {}
_INT32 = (-2**31, 2**31 - 1)


class _NotFast(Exception):
    pass


def _spec(a):
    """What Triton specializes a runtime argument on (dtype and 16-byte alignment of a tensor;
    an int's value 1, divisibility by 16 and width), as a hashable key part."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a == 1, a & 15 == 0, _INT32[0] <= a <= _INT32[1])
    if isinstance(a, float):
        return "f"
    if a is None:
        return None
    if isinstance(a, TensorDescriptor):
        # Triton specializes a host-side descriptor on its element type, block shape and padding
        # (shape and strides are runtime arguments); the compiled launcher expands it per call
        return ("desc", a.base.dtype, tuple(a.block_shape), a.padding)
    raise _NotFast  # anything else: Triton's own launch path


_CONSTEXPRS: dict = {}


def _constexpr_names(kernel) -> frozenset:
    """The names of a @triton.jit kernel's tl.constexpr parameters (read from its annotations, which are strings
    under `from __future__ import annotations`; the interpreter's function object has no `params`)."""
    got = _CONSTEXPRS.get(kernel)
    if got is None:
        fn = getattr(kernel, "fn", kernel)
        ann = getattr(fn, "__annotations__", {})
        got = _CONSTEXPRS[kernel] = frozenset(
            n for n, a in ann.items() if a is tl.constexpr or (isinstance(a, str) and a.split(".")[-1] == "constexpr"))
    return got


def check_launch_args(kernel, args: tuple, meta: dict) -> None:
    """launch's contract, checked where a launch is first cached and on every interpreted launch (so CI sees a
    misuse that only the GPU's cached path would turn into a wrong answer): the positional arguments are the
    kernel's leading runtime parameters, every later parameter is a constexpr (the cached path replays the first
    call's values of those), and no runtime parameter comes as a keyword. TypeError naming the parameter."""
    names = list(kernel.arg_names)
    const = _constexpr_names(kernel)
    head = names[:len(args)]
    late = [n for n in names[len(args):] if n not in const]
    if late:
        raise TypeError(f"launch({getattr(kernel, '__name__', kernel)}): runtime parameter(s) {late} not passed "
                        "positionally; pass every runtime argument positionally, in order (only constexprs and "
                        "launch options as keywords)")
    bad = [n for n in head if n in const or n in meta]
    if bad:
        raise TypeError(f"launch({getattr(kernel, '__name__', kernel)}): {bad} passed positionally are constexprs "
                        "or also given as keywords; constexprs go as keywords, after the runtime arguments")


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed (a profiler's): Triton 3.6 keeps an always-present,
    usually empty HookChain where older versions kept None (testing `is not None` sent every launch
    down Triton's slow path)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid: tuple, *args, **meta):
    """`kernel[grid](*args, **meta)` with the per-call host work cut from ~25-45 us to a few
    (measured on the H200's host: JITFunction.run's binding, cache-key string, global-value
    checks and launch-metadata calls dominate a decode-sized QuantLinear). The compiled kernel is
    cached under the same facts Triton specializes on (each tensor's dtype and 16-byte
    alignment, each int's ==1 / %16 / int32-range, the constexpr keywords, the device), so a
    call that would compile differently misses the cache and goes through Triton (which then
    compiles or finds its own cached binary). Positional `args` are the kernel's runtime
    parameters in order; constexprs and launch options go in `meta`. The interpreter, launch
    hooks (profilers) and any argument of another type always take Triton's path."""
    from triton import knobs
    from triton.runtime.driver import driver

    if interpreting() or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        check_launch_args(kernel, args, meta)
        note_slow_launch()
        return kernel[grid](*args, **meta)
    drv = driver.active
    dev = drv.get_current_device()
    try:
        key = (kernel, dev, tuple(meta.items()), tuple(_spec(a) for a in args))
    except _NotFast:
        note_slow_launch()
        return kernel[grid](*args, **meta)
    hit = _LAUNCH_CACHE.get(key)
    if hit is None:
        check_launch_args(kernel, args, meta)
        ck = kernel[grid](*args, **meta)   # compiles (or finds) and launches this call
        names = kernel.arg_names[len(args):]
        defaults = {p.name: p.default for p in kernel.params}
        tail = tuple(meta[n] if n in meta else defaults[n] for n in names)
        _LAUNCH_CACHE[key] = (ck, tail)
        note_launch(ck, grid, args, tail)
        return ck
    ck, tail = hit
    note_launch(ck, grid, args, tail)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    ck.run(grid[0], g1, g2, drv.get_current_stream(dev), ck.function, ck.packed_metadata, None, None, None,
           *args, *tail)
    return ck


# ---------------------------------------------------------------- argument checks (host side)

def check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {t.device}; the Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 for the CPU interpreter): move it with .cuda() "
                         "or call lowbit.ops.linear(..., backend='torch'|'reference')")


def check_matrix(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """A 2-D operand with a unit stride along K (the contraction axis) and an allowed dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(t.shape)}; "
                         "flatten leading dimensions first (x.reshape(-1, K))")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of: {names}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along K (stride(1) == 1), got strides "
                         f"{t.stride()}; pass {name}.contiguous() (weights are stored [N, K], K-major)")
    check_device(name, t)


def check_vector(name: str, t: torch.Tensor | None, length: int, dtype: torch.dtype,
                 allow_scalar: bool = True) -> torch.Tensor | None:
    """A per-row vector of `length` (or a single value broadcast to it). Returns a 1-D tensor of
    `length` whose stride is 1, or 0 for a broadcast single value (kernels take the stride, so a
    tensor-wise scale costs no copy); never converts dtype silently."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype} (convert it explicitly)")
    flat = t.reshape(-1)
    if flat.numel() == length:
        return flat.contiguous()
    if allow_scalar and flat.numel() == 1:
        return flat.expand(length)
    raise ValueError(f"{name} has {flat.numel()} values; expected {length} (one per row)"
                     + (" or 1 (tensor-wise)" if allow_scalar else ""))


def check_out_dtype(out_dtype: torch.dtype, allowed=(torch.bfloat16, torch.float16, torch.float32)) -> None:
    if out_dtype not in allowed:
        raise ValueError(f"out_dtype={out_dtype} is not supported; choose one of "
                         + ", ".join(str(d) for d in allowed))


def check_operands(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of the checked operands A [M, K] and B [N, K]: K and the device must match."""
    M, K = a.shape
    N, Kb = b.shape
    if Kb != K:
        raise ValueError(f"a is [M, K] = {tuple(a.shape)} but b is [N, K] = {tuple(b.shape)}: "
                         "K must match (weights are stored [N, K], K-major)")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}")
    return M, N, K


def check_bias(bias: torch.Tensor | None, N: int) -> torch.Tensor | None:
    """An optional bias of N values in fp32 / bf16 / fp16 (the epilogue adds it in fp32)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError("bias must be a float32, bfloat16 or float16 tensor of N values")
    return check_vector("bias", bias, N, bias.dtype, allow_scalar=False)


# ---------------------------------------------------------------- launch configurations

def _cfg(bm, bn, bk, warps, stages, group_m=8):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, num_warps=warps, num_stages=stages)


def pick_config(M: int, N: int, K: int, *, block_k_multiple: int = 1, kind: str = "int8") -> dict:
    """Tile sizes for an 8-bit GEMM with K-major operands on an H100/H200-class GPU.

    Chosen per M bucket (no run-time autotuning, so compile time stays bounded); the large-M
    choices come from timed alternatives on the H200 (docs/benchmarks.md has the numbers):
    - M <= 64: decode-like, bound by reading the weights; BLOCK_M just covers M and BLOCK_N is
      lowered until there are about as many programs as SMs (132) so every SM streams weights.
    - M <= 128: int8 / fp8: 64-row tiles, BLOCK_K 256 (faster, see below); block-scaled: one 128-row
      tile, BLOCK_N 128/64/32 so that >= 120 programs stream the weights once.
    - M < 2048: 64-row tiles, BLOCK_N 128 or 64 for the same occupancy reason.
    - M >= 2048: 128x256 (int8) / 256x128 (fp8) / 128x128 (block-scaled) tiles, 8 warps,
      3 stages, operands through TMA descriptors, GROUP_M swizzle for L2 reuse.
    kind: "int8", "fp8", "block128", "block32" / "block64" (fp32 group scales) or "mx". In the interpreter, small tiles keep
    the tests fast and exercise the masking.
    """
    if interpreting():
        bk = max(32, block_k_multiple)
        return _cfg(16, 16, bk, 4, 1, group_m=2)
    sms = 132
    if M <= 64:
        bm = 16 if M <= 16 else (32 if M <= 32 else 64)
        bn = 64
        if triton.cdiv(N, bn) < sms:
            bn = 32
        bk = max(256, block_k_multiple)
        return _cfg(bm, bn, bk, 4, 4)
    if M <= 128 and kind in ("int8", "fp8"):
        # two 64-row tiles with BLOCK_K 256 and 4 stages, no TMA: ~1.4x the one 128-row TMA tile
        # below at 128 x 4096 x 14336 (int8 and fp8 row-wise; `scripts/gpu.sh gemm` times both): the
        # weights are read twice, but mostly from L2, and 128 programs stream K.
        bn = 64 if triton.cdiv(M, 64) * triton.cdiv(N, 64) >= 120 else 32
        return _cfg(64, bn, max(256, block_k_multiple), 4, 4)
    if M <= 128:
        # One 128-row tile covers M, so the weights are streamed once; BLOCK_N is lowered until
        # about 120+ programs share the stream (a 64-row tile would read the weights twice).
        bn = next((b for b in (128, 64) if triton.cdiv(N, b) >= 120), 32)
        cfg = _cfg(128, bn, max(128, block_k_multiple), 4, 4)
        cfg["TMA"] = True
        return cfg
    if M < 2048:
        bn = 128 if triton.cdiv(M, 64) * triton.cdiv(N, 128) >= sms else 64
        return _cfg(64, bn, max(128, block_k_multiple), 4, 4)
    if kind == "fp8":
        cfg = _cfg(256, 128, 128, 8, 3)
    elif kind.startswith("block") or kind == "mx":
        cfg = _cfg(128, 128, 128, 8, 3)
    else:
        cfg = _cfg(128, 256, 128, 8, 4)
    cfg["TMA"] = True
    return cfg


def launch_grid(M: int, N: int, cfg: dict) -> tuple[int]:
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    if cfg.get("PERSISTENT"):
        return (min(tiles, num_sms()),)
    return (tiles,)


_SMS: dict = {}


def num_sms() -> int:
    """Multiprocessors of the current GPU (persistent kernels launch one program per SM)."""
    if interpreting():
        return 4
    if not _SMS:  # first call: is CUDA there at all (not asked again: it costs host time per launch)
        _SMS[None] = 4 if not torch.cuda.is_available() else None
    if _SMS[None] == 4:
        return 4
    dev = torch.cuda.current_device()
    n = _SMS.get(dev)
    if n is None:
        n = _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return n


def split_launch_options(cfg: dict, K: int, elem_bytes: int, tensors) -> tuple[dict, bool]:
    """Kernel keyword arguments from a config (TMA / PERSISTENT become constexpr flags) and
    whether the operands may be read through TMA descriptors: the bulk-copy engine needs
    16-byte aligned bases and row strides (K * elem_bytes % 16 == 0); otherwise the pointer
    path runs (the same arithmetic, only the loads differ)."""
    cfg = dict(cfg)
    want_tma = bool(cfg.pop("TMA", False))
    persistent = bool(cfg.pop("PERSISTENT", False))
    tma = want_tma and (K * elem_bytes) % 16 == 0 and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * elem_bytes) % 16 == 0 for t in tensors)
    cfg.update(USE_TMA=tma, PERSISTENT=persistent, NUM_SMS=num_sms())
    return cfg, tma


def descriptor(t: torch.Tensor, rows: int, cols: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, cols])


def prepare_launch(cfg: dict, a: torch.Tensor, b: torch.Tensor, box_k: int | None = None):
    """Everything a GEMM launch derives from its config, for K-major 8-bit A [M, K], B [N, K]:
    returns (grid, kernel keyword options, A argument, B argument). The operand arguments are
    TMA descriptors of [BLOCK_M | BLOCK_N, box_k] boxes (box_k defaults to BLOCK_K) when the
    config asks for TMA and the operands allow it (split_launch_options), else the tensors."""
    M, K = a.shape
    grid = launch_grid(M, b.shape[0], cfg)
    opts, tma = split_launch_options(cfg, K, 1, (a, b))
    if not tma:
        return grid, opts, a, b
    box_k = cfg["BLOCK_K"] if box_k is None else box_k
    return grid, opts, descriptor(a, cfg["BLOCK_M"], box_k), descriptor(b, cfg["BLOCK_N"], box_k)


@triton.jit
def mainloop(a_ptr, b_ptr, off_m, off_n, M, N, K, stride_am, stride_bn,
             ACC_INT: tl.constexpr, PRECISE: tl.constexpr, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PROMOTE_K: tl.constexpr = 128):
    """acc[BLOCK_M, BLOCK_N] = A[off_m:, :] @ B[off_n:, :].T for K-major 8-bit A [M, K], B [N, K].

    ACC_INT: int32 accumulation (int8 operands), else fp32 (fp8). PRECISE (fp8 on sm_90):
    promote the tensor cores' partial sum into the fp32 accumulator every PROMOTE_K products
    (min(BLOCK_K, 128): the host passes it).
    USE_TMA: a_ptr / b_ptr are TensorDescriptors (bulk tensor copies; out-of-range rows and K
    are zero-filled by the copy engine), else plain pointers with masks on K.
    """
    if ACC_INT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, K, BLOCK_K):
            a = a_ptr.load([off_m, k0])
            b = b_ptr.load([off_n, k0])
            if ACC_INT:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            elif PRECISE:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE_K)
            else:
                acc = tl.dot(a, b.T, acc)
    else:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past M / N are clamped (not masked): they compute values that are never stored,
        # and unmasked rows keep the loads vectorised.
        rows_a = tl.where(offs_m < M, offs_m, 0)
        rows_b = tl.where(offs_n < N, offs_n, 0)
        a_ptrs = kmajor_ptrs(a_ptr, rows_a, stride_am, offs_k)
        b_ptrs = kmajor_ptrs(b_ptr, rows_b, stride_bn, offs_k)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k[None, :] < K - k0
                if ACC_INT:
                    a = tl.load(a_ptrs, mask=k_ok, other=0)
                    b = tl.load(b_ptrs, mask=k_ok, other=0)
                else:
                    a = tl.load(a_ptrs, mask=k_ok, other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok, other=0.0)
            if ACC_INT:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
            elif PRECISE:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE_K)
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    return acc


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a linear program id to (pid_m, pid_n), GROUP_M tile rows at a time (L2 reuse)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % size_m)
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


# ---------------------------------------------------------------- tile fragments (inlined by Triton)

@triton.jit
def kmajor_ptrs(ptr, rows, stride, offs_k):
    """Pointers [len(rows), len(offs_k)] to elements (rows, offs_k) of a K-major matrix; the row
    offset is taken in int64 so that rows * stride cannot overflow on large operands."""
    return ptr + rows[:, None].to(tl.int64) * stride + offs_k[None, :]


@triton.jit
def tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output tile (pid_m, pid_n): its row and column indices and their in-range masks."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def rowcol_scale(accf, offs_m, offs_n, m_ok, n_ok, sa_ptr, sb_ptr, stride_sa, stride_sb):
    """(accf * sa[m]) * sb[n] in fp32, in that order (two roundings): per-row scales of A and
    per-column scales of B; a stride of 0 broadcasts one tensor-wise scale."""
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=m_ok, other=0.0)
    sb = tl.load(sb_ptr + offs_n * stride_sb, mask=n_ok, other=0.0)
    return (accf * sa[:, None]) * sb[None, :]


@triton.jit
def add_bias(y, offs_n, n_ok, bias_ptr, HAS_BIAS: tl.constexpr):
    """y + bias[n] in fp32 (one rounding) when HAS_BIAS, else y unchanged. On the GPU, when y is
    a product (rowcol_scale's), Triton contracts the two into one FMA: one rounding for both."""
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def store_tile(c_ptrs, y, m_ok, n_ok):
    """y converted to C's dtype by cast_out (round-to-nearest-even; an int32 y into int32 C is
    stored as is), stored where the row < M and the column < N.
    c_ptrs: kmajor_ptrs(c_ptr, offs_m, stride_cm, offs_n) of C [M, N]."""
    tl.store(c_ptrs, cast_out(y, c_ptrs.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def bias_store_tile(y, offs_m, offs_n, m_ok, n_ok, c_ptr, stride_cm, bias_ptr, HAS_BIAS: tl.constexpr):
    """add_bias, then store_tile at C [M, N] (row stride stride_cm): the GEMMs' last epilogue step.

    Written out rather than composed of the two helpers, and the int8 kernel calls them apart
    (its output pointers come before its scale loads): ptxas -lineinfo keeps a label per inlined
    call, and extra nesting or a moved address computation changed the sm_90 machine code of
    some kernels; in this form every kernel compiles to the same SASS as before the helpers."""
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, cast_out(y, c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
