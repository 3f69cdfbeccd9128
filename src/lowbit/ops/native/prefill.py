"""lowbit's native prefill GEMMs (csrc/prefill_kernels.cu, built with CUTLASS) as torch functions.

    y = fp8_rowwise_gemm(a, b, sa, sb, bias=None, config=0)    # sa [M], sb [N]
    y = fp8_blockwise_gemm(a, b, sa, sb, bias=None, config=0)  # sa [M, K/128], sb [ceil(N/128), K/128]

a: e4m3 activation codes [M, K], b: e4m3 weight codes [N, K] (both contiguous, K-major; torch.float8_e4m3fn or
the uint8 bit patterns a QTensor holds), float32 scales in the layouts lowbit.quantize stores (the "fp8_row" /
per-token schemes, and "fp8_block128" weights with "fp8_block1x128" activations), an optional float32 bias [N];
the output is bf16 [M, N] on the operands' CUDA device (sm_90). The rounding order of each kernel is in
prefill_kernels.cu's header comment: row-wise out = bf16(((acc * sa[m]) * sb[n]) + bias[n]); block-wise, each
128-wide k block's sum is scaled by sa[m, kb] * sb[n / 128, kb] before it joins the float32 accumulator, then
out = bf16(acc + bias[n]).

Every argument is checked here, once, before the library is loaded (the checks need no GPU); the C side
trusts them. `config` picks one of the compiled tile configurations (ROWWISE_CONFIGS, BLOCKWISE_CONFIGS),
which change the speed and the summation order inside the tensor core, never the documented rounding order.
The block-wise kernel reads the activation scales M-major (CUTLASS's TMA path for them): each call copies sa
into a [K/128, M rounded up to 4] float32 buffer first (M * K / 128 * 4 bytes).
A per-token fp8 W8A8 layer runs the row-wise GEMM where the tuning table says "cutlass"
(lowbit.ops.kernels.dense_w8.CutlassW8A8Fp8); the block-wise one is called by the tests and
scripts/gpu_native_prefill.py only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .library import load_prefill

BLOCK = 128         # the block-wise scales' group along K and block along N
ALIGN_BYTES = 16    # TMA rows and the epilogue's vector loads


@dataclass(frozen=True)
class PrefillConfig:
    """One compiled configuration of a prefill GEMM (csrc/prefill_kernels.cu's Row* / Block* types)."""
    tile: tuple[int, int, int]      # CTA tile M x N x K
    cluster: tuple[int, int]        # CTAs per cluster along M, N
    schedule: str                   # CUTLASS's kernel schedule: "cooperative" (2 consumer warp groups share a tile)
                                    # or "pingpong" (each warp group its own tile)
    fast_accum: bool                # the tensor-core accumulator runs over all of K (else promoted every 128)

    def describe(self) -> str:
        m, n, k = self.tile
        return (f"{m}x{n}x{k} {self.schedule} cluster {self.cluster[0]}x{self.cluster[1]}"
                + (" fast-accum" if self.fast_accum else ""))


ROWWISE_CONFIGS = (
    PrefillConfig((128, 128, 128), (1, 1), "cooperative", False),
    PrefillConfig((128, 128, 128), (2, 1), "cooperative", False),
    PrefillConfig((128, 256, 128), (2, 1), "cooperative", True),
    PrefillConfig((128, 128, 128), (2, 1), "pingpong", True),
)
BLOCKWISE_CONFIGS = (
    PrefillConfig((128, 128, 128), (1, 1), "cooperative", False),
    PrefillConfig((128, 128, 128), (1, 2), "cooperative", False),
)
# csrc/prefill_kernels.cu's Refusal codes
REFUSALS = {-1: "M, N or K not positive", -2: "K or N not a supported multiple", -3: "config outside the table",
            -4: "bad activation-scale stride", -5: "CUTLASS's can_implement refused the problem",
            -6: "the kernel asks for a workspace", -7: "CUTLASS's launch failed"}


def _codes(name: str, t, who: str) -> torch.Tensor:
    """An e4m3 code matrix [rows, K], contiguous: as torch.float8_e4m3fn or its uint8 bit patterns."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float8_e4m3fn, torch.uint8) or t.ndim != 2:
        raise ValueError(f"{who}: {name} must be a 2-D torch.float8_e4m3fn (or uint8 e4m3 bits) tensor [rows, K], got "
                         f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous (K-major, row stride K), got strides {t.stride()}; "
                         f"pass {name}.contiguous()")
    return t


def _shapes(a, b, who: str, k_multiple: int) -> tuple[int, int, int]:
    """(M, N, K) of checked operands, with the kernels' constraints on them."""
    a, b = _codes("a", a, who), _codes("b", b, who)
    (M, K), (N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"{who}: a is [M, K] = {tuple(a.shape)} but b is [N, K] = {tuple(b.shape)}: K must match "
                         "(weights are stored [N, K], K-major)")
    if M < 1 or N < 1 or K < 1:
        raise ValueError(f"{who}: M, N and K must be positive, got M = {M}, N = {N}, K = {K}")
    if K % k_multiple:
        raise ValueError(f"{who}: K = {K} must be a multiple of {k_multiple}; pad K with zero codes to "
                         f"{-(-K // k_multiple) * k_multiple} (zeros add nothing) before quantizing")
    if N % 16:
        raise ValueError(f"{who}: N = {N} must be a multiple of 16 (16-byte output rows); pad the weight's rows "
                         f"with zeros to {-(-N // 16) * 16} and drop the extra output columns")
    return M, N, K


def _scales(name: str, t, shape: tuple[int, ...], what: str, who: str) -> torch.Tensor:
    """A float32 scale tensor of `shape` (a vector may come as [n, 1]: a QTensor's per-row scales), contiguous."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ValueError(f"{who}: {name} must be a float32 tensor {what}, got {getattr(t, 'dtype', type(t).__name__)}; "
                         f"pass {name}.float()")
    ok = tuple(t.shape) == shape or (len(shape) == 1 and tuple(t.shape) == (shape[0], 1))
    if not ok:
        raise ValueError(f"{who}: {name} must have shape {what} = {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {name} must be contiguous, got strides {t.stride()}; pass {name}.contiguous()")
    return t.reshape(shape)


def _bias(bias, N: int, who: str) -> torch.Tensor | None:
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        raise ValueError(f"{who}: bias must be a float32 tensor [N] (the epilogue adds it in float32), got "
                         f"{getattr(bias, 'dtype', type(bias).__name__)}; pass bias.float()")
    if tuple(bias.shape) != (N,) or not bias.is_contiguous():
        raise ValueError(f"{who}: bias must be a contiguous [N] = [{N}] tensor, got shape {tuple(bias.shape)}; "
                         "pass bias.reshape(-1).contiguous()")
    return bias


def _config(config, table: tuple[PrefillConfig, ...], who: str) -> int:
    if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < len(table):
        raise ValueError(f"{who}: config must be an int in 0..{len(table) - 1} (the compiled tile configurations: "
                         + "; ".join(f"{i}: {c.describe()}" for i, c in enumerate(table)) + f"), got {config!r}")
    return config


def _placement(tensors: dict[str, torch.Tensor | None], aligned: tuple[str, ...], who: str) -> torch.device:
    """The one CUDA device of all tensors; those named in `aligned` must start on a 16-byte boundary."""
    device = tensors["a"].device
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != "cuda":
            raise ValueError(f"{who}: {name} is on {t.device}; the native prefill GEMMs need CUDA tensors on an sm_90 "
                             "GPU (lowbit's Triton GEMMs run elsewhere): move it with .cuda()")
        if t.device != device:
            raise ValueError(f"{who}: {name} is on {t.device}, a on {device}; move one of them")
        if name in aligned and t.data_ptr() % ALIGN_BYTES:
            raise ValueError(f"{who}: {name} must start on a {ALIGN_BYTES}-byte boundary (a view into another tensor "
                             f"is not); pass {name}.clone()")
    return device


def _raise(code: int, who: str) -> None:
    if code:
        why = REFUSALS.get(code, "a cudaError_t")
        raise RuntimeError(f"{who}: the native launch failed with code {code} ({why})")


def _launch_fn(name: str, table: tuple[PrefillConfig, ...], blockwise: bool, who: str):
    lib = load_prefill()
    if lib.lb_prefill_configs(int(blockwise)) != len(table):   # a library built from other sources
        raise RuntimeError(f"{who}: the prefill library holds {lib.lb_prefill_configs(int(blockwise))} configurations, "
                           f"this lowbit describes {len(table)}: rebuild it (python -m lowbit.ops.native.build --prefill)")
    return getattr(lib, name)


def _out(M: int, N: int, device: torch.device) -> torch.Tensor:
    return torch.empty(M, N, dtype=torch.bfloat16, device=device)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def fp8_rowwise_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                     bias: torch.Tensor | None = None, config: int = 0) -> torch.Tensor:
    """bf16 [M, N] = ((a @ b.T) * sa[m]) * sb[n] (+ bias[n]) for e4m3 a [M, K], b [N, K] (K % 16 == 0,
    N % 16 == 0), float32 sa [M] and sb [N] (or [M, 1] / [N, 1]), float32 bias [N]."""
    who = "fp8_rowwise_gemm"
    M, N, K = _shapes(a, b, who, 16)
    sa = _scales("sa", sa, (M,), "[M]", who)
    sb = _scales("sb", sb, (N,), "[N]", who)
    bias = _bias(bias, N, who)
    cfg = _config(config, ROWWISE_CONFIGS, who)
    device = _placement({"a": a, "b": b, "sa": sa, "sb": sb, "bias": bias}, ("a", "b", "sb", "bias"), who)
    fn = _launch_fn("lb_fp8_rowwise_gemm", ROWWISE_CONFIGS, False, who)
    out = _out(M, N, device)
    _raise(fn(a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(), _ptr(bias), out.data_ptr(), M, N, K, cfg,
              _stream(device)), who)
    return out


def mmajor_scales(sa: torch.Tensor) -> torch.Tensor:
    """Activation block scales [M, K/128] as the block-wise kernel reads them: [K/128, ld] float32 with
    ld = M rounded up to 4 (TMA strides are multiples of 16 bytes), rows M..ld-1 zero."""
    M, G = sa.shape
    ld = -(-M // 4) * 4
    out = sa.new_zeros(G, ld) if ld != M else sa.new_empty(G, ld)
    out[:, :M] = sa.t()
    return out


def fp8_blockwise_gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                       bias: torch.Tensor | None = None, config: int = 0) -> torch.Tensor:
    """bf16 [M, N] = sum over 128-wide k blocks of (a @ b.T)_kb * sa[m, kb] * sb[n / 128, kb] (+ bias[n]) for
    e4m3 a [M, K], b [N, K] (K % 128 == 0, N % 16 == 0), float32 sa [M, K/128] (1 x 128 activation groups),
    float32 sb [ceil(N/128), K/128] (128 x 128 weight blocks), float32 bias [N]."""
    who = "fp8_blockwise_gemm"
    M, N, K = _shapes(a, b, who, BLOCK)
    G = K // BLOCK
    sa = _scales("sa", sa, (M, G), "[M, K/128]", who)
    sb = _scales("sb", sb, (-(-N // BLOCK), G), "[ceil(N/128), K/128]", who)
    bias = _bias(bias, N, who)
    cfg = _config(config, BLOCKWISE_CONFIGS, who)
    device = _placement({"a": a, "b": b, "sa": sa, "sb": sb, "bias": bias}, ("a", "b", "bias"), who)
    fn = _launch_fn("lb_fp8_blockwise_gemm", BLOCKWISE_CONFIGS, True, who)
    sa_t = mmajor_scales(sa)
    out = _out(M, N, device)
    _raise(fn(a.data_ptr(), b.data_ptr(), sa_t.data_ptr(), sa_t.shape[1], sb.data_ptr(), _ptr(bias), out.data_ptr(), M, N,
              K, cfg, _stream(device)), who)
    return out
