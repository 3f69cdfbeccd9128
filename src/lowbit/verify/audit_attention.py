"""`lowbit audit --attention`: attention kernels checked by check_attention over an adversarial
case set, as the same conformance table as the linear audit (verify/audit.py: Cell, table, plot).

Kernels (each gets q, and the cache as lowbit.ops.kv_quant stores it; its output is checked
against the float64 quantization-aware attention reference, lowbit.ops.attention_reference):
- lowbit's own: the float64 reference (a sanity row), the exact torch path and the Triton
  flash-attention kernel with fp8 (per KV head, static) and int8 (per token, dynamic) caches,
  fp8 / int8 Q and P. Without CUDA the Triton rows run in Triton's CPU interpreter, at the small
  sizes the cases use.
- torch's scaled_dot_product_attention over an unquantized cache: in fp32 (it must pass the fp32
  gate) and in bf16, the baseline a quantized kernel replaces. The bf16 row is held to what the
  check states (q, k, v as the bf16 values it reads, P and O in fp32, a bf16 output): its bf16
  scores / P show as numerical, named computed_in_bf16 when within the bf16 bound
  (lowbit.verify.attention.bf16_intermediates_bound), a logic error when beyond it.
Cases: decode with GQA, causal prefill at a head dim that is no tile multiple, full attention with
a key count that is no block multiple, outlier key channels, an all-zero KV head, scores growing
along the keys (the online-softmax rescale in every block), and one dominant key (the softmax
tail that P scaled per tensor would lose). A refusal (NotImplementedError / ValueError) is n/a
with the reason; any other exception is an error cell.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale
from lowbit.verify.attention import check_attention
from lowbit.verify.audit import Cell, audit_grid, refused_cell, verdict_cell

P_BLOCK = 16          # small key blocks: several blocks (and rescales) at the cases' small lengths


@dataclass
class AttnCase:
    name: str
    B: int
    Hq: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    causal: bool = True
    edit: Callable | None = None      # (rng, q, k, v) -> q, k, v: what makes the case adversarial


@dataclass
class AttnKernel:
    """One attention kernel under audit: fn(q, k, v, spec) -> out [B, Hq, Tq, D]; k, v are KVQuant
    (kv_scheme given) or float tensors in `dtype` (kv_scheme None); q is given in `dtype`."""

    name: str
    kv_scheme: KVScheme | None
    spec: ar.AttnSpec
    fn: Callable
    dtype: torch.dtype = torch.float32
    out_dtype: torch.dtype = torch.float32
    note: str = ""
    # a numerical verdict is this row's documented rounding (the unquantized bf16 baseline), not a
    # finding: the cell is marked expected and does not fail `lowbit audit`'s exit status
    numerical_expected: bool = False


def _outlier_k(rng, q, k, v):
    cols = torch.randperm(k.shape[-1], generator=rng)[:3]
    k[..., cols] *= 30.0                         # LLM-style outlier key channels
    return q, k, v


def _zero_head(rng, q, k, v):
    k[:, -1] = 0.0
    v[:, -1] = 0.0                               # scale 1, zero codes: scores 0, output mean(V) = 0
    return q, k, v


def _growing(rng, q, k, v):
    # every key block holds a larger score than the ones before it: the running max moves in each
    # block, so O and l are rescaled every time (a skipped or misapplied rescale shows)
    ramp = torch.linspace(0.2, 3.0, k.shape[2]).reshape(1, 1, -1, 1)
    d = q[:, :1, -1:].mean(dim=(0, 1, 2)).reshape(1, 1, 1, -1)
    return q, k * 0.2 + ramp * d / d.norm() * k.shape[-1] ** 0.5, v


def _dominant(rng, q, k, v):
    # one key far above the rest: the others' weights are ~2^-10 of it, the tail P per tensor loses
    d = q[:, :1, -1:].mean(dim=(0, 1, 2))
    k[:, :, 3] = d / d.norm() * 4.0 * k.shape[-1] ** 0.5
    return q, k, v


CASES = [AttnCase("decode, GQA 3", 2, 6, 2, 1, 45, 40),
         AttnCase("prefill, causal, D=40", 1, 4, 2, 21, 21, 40),
         AttnCase("full, Tk not a block multiple", 1, 2, 1, 5, 37, 24, causal=False),
         AttnCase("outlier K channels", 1, 4, 2, 6, 40, 32, edit=_outlier_k),
         AttnCase("all-zero KV head", 1, 4, 2, 4, 33, 32, edit=_zero_head),
         AttnCase("scores growing along keys", 1, 2, 1, 3, 64, 32, edit=_growing),
         AttnCase("one dominant key", 1, 2, 1, 4, 48, 32, edit=_dominant)]


# ------------------------------------------------------------------------------------------
# Kernels found on this machine
# ------------------------------------------------------------------------------------------
def _lowbit(backend: str):
    def fn(q, k, v, spec):
        return attention(q, k, v, spec, backend=backend, out_dtype=torch.float32)
    return fn


def _sdpa(q, k, v, spec):
    """torch SDPA over the unquantized cache: K / V repeated per query head (GQA) and the causal
    mask given explicitly, bottom-right aligned (SDPA's is_causal aligns top-left, which is wrong
    for a decode step behind a cache)."""
    G = q.shape[1] // k.shape[1]
    mask = ar.allowed_mask(q.shape[2], k.shape[2], spec.causal, q.device)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), attn_mask=mask, scale=spec.sm_scale)


def discover(triton_ok: bool) -> list[AttnKernel]:
    """Every attention kernel this machine can run, with the cache and spec it computes."""
    fp8h, i8t = KVScheme("fp8_e4m3fn", "head"), KVScheme("int8", "token")
    f8 = ar.AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn", p_block=P_BLOCK)
    i8 = ar.AttnSpec(q_format="int8", p_format="int8", p_block=P_BLOCK)
    specs = [AttnKernel("lowbit attention reference (float64)", fp8h, f8, _lowbit("reference"),
                        note="the exact reference itself: must always pass"),
             AttnKernel("lowbit attention torch, fp8 KV per head", fp8h, f8, _lowbit("torch")),
             AttnKernel("lowbit attention torch, int8 KV per token", i8t, i8, _lowbit("torch"))]
    if triton_ok:
        specs += [AttnKernel("lowbit triton attention, fp8 KV per head", fp8h, f8, _lowbit("triton")),
                  AttnKernel("lowbit triton attention, int8 KV per token", i8t, i8, _lowbit("triton"))]
    plain = ar.AttnSpec(q_format=None, p_format=None, p_block=P_BLOCK)
    specs += [AttnKernel("torch SDPA fp32", None, plain, _sdpa, note="float32 throughout: must pass the fp32 gate"),
              AttnKernel("torch SDPA bf16 (unquantized baseline)", None, plain, _sdpa, dtype=torch.bfloat16,
                         out_dtype=torch.bfloat16, note="bf16 q, k, v and output; held to P and O in fp32, "
                                                        "so bf16 intermediates show as numerical: computed_in_bf16",
                         numerical_expected=True)]
    return specs


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
def _inputs(case: AttnCase, rng: torch.Generator):
    q = torch.randn(case.B, case.Hq, case.Tq, case.D, generator=rng) * 1.5
    k = torch.randn(case.B, case.Hkv, case.Tk, case.D, generator=rng)
    v = torch.randn(case.B, case.Hkv, case.Tk, case.D, generator=rng)
    return case.edit(rng, q, k, v) if case.edit is not None else (q, k, v)


def _cache(x: torch.Tensor, scheme: KVScheme | None, name: str):
    if scheme is None:
        return x
    if scheme.dynamic:
        return quantize_kv(x, scheme, name=name)
    return quantize_kv(x, scheme, static_scale(observe_amax(x, scheme, name), scheme), name=name)


def run_cell(kernel: AttnKernel, case: AttnCase, device: str, seed: int) -> Cell:
    rng = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(case, rng)
    # what the kernel reads is what the check sees: bf16 rows get bf16-rounded inputs
    q, k, v = (t.to(kernel.dtype).float() for t in (q, k, v))
    spec = ar.AttnSpec(q_format=kernel.spec.q_format, p_format=kernel.spec.p_format, p_block=kernel.spec.p_block,
                       causal=case.causal, sm_scale=kernel.spec.sm_scale)
    t0 = time.perf_counter()
    try:
        kq, vq = _cache(k, kernel.kv_scheme, "k"), _cache(v, kernel.kv_scheme, "v")
        to = (lambda t: t.to(device)) if kernel.kv_scheme is not None else (lambda t: t.to(device, kernel.dtype))
        out = kernel.fn(q.to(device, kernel.dtype), to(kq), to(vq), spec)
    except Exception as e:      # a refusal (n/a) or a crash (error): audit.refused_cell
        return refused_cell(kernel.name, case.name, e, t0)
    vd = check_attention(out.detach().cpu(), q, kq, vq, spec, out_dtype=kernel.out_dtype)
    cell = verdict_cell(kernel.name, case.name, vd, t0)
    cell.expected = kernel.numerical_expected and cell.verdict == "numerical"
    return cell


def audit(kernels: list[AttnKernel], cases: list[AttnCase] = CASES, *, device: str = "cpu", seed: int = 0,
          progress: Callable[[str], None] | None = None) -> list[Cell]:
    """Every kernel on every case; one Cell per pair (kernel-major), for verify.audit.table / plot."""
    return audit_grid(run_cell, kernels, cases, device, seed, progress)
