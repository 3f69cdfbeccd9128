"""The attention kernels as classes: which kernel reads a (quantized) KV cache for one call.

  class        name      what it runs                                           the cache it reads
  SplitKV      split_kv  flash-decoding: decode steps and short query blocks,   bf16, or codes scaled per
                         G x Tq <= SPLIT_KV_MAX_ROWS rows per KV head           tensor / head / token
                         (lowbit.ops.triton.attention_decode)
  Prefill      prefill   tensor-core tiles, one tiling per PrefillConfig        K per tensor / head / token,
                         (lowbit.ops.triton.attention_prefill)                  V per tensor / head; or bf16
  Flash        flash     the general kernel (lowbit.ops.triton.attention)       every layout
  SdpaDequant  sdpa      torch SDPA over the dequantized cache, only where      every layout; NOT lowbit's
                         chosen (lowbit.ops.attention_sdpa)                     P-quantized arithmetic

ATTENTION holds them in that order. A call's facts (AttentionCall: query tokens, GQA group, head_dim,
how Q arrives, each cache operand's layout, the AttnSpec) go to each class's `can_run`; the first that
can run the call runs it. For a call of more than one query token a tuning table may choose among the
`choosable` classes (lowbit.ops.tuning's "attention" cells name a class by its `name`, or by its
`table_path` "dequant" for SDPA); split-KV still comes first where it runs the call, as a decode step
is never tuned. A caller's choice the kernel cannot run is refused with the reason; a table's is passed
over (recorded in the Choice) and the preference order decides.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops import tuning
from lowbit.ops.attention_sdpa import sdpa_attention
from lowbit.ops.kernels.attention_call import SPLIT_KV_MAX_ROWS, AttentionCall, prefill_refusal
from lowbit.ops.kernels.base import Choice, Device, Kernel, Registry

class AttentionKernel(Kernel):
    """An attention kernel: `refuses(call)` says which calls it does not take, `apply` runs one.
    `name` is what tuning tables, `kernel=` arguments and last_path() call it."""
    kind: ClassVar[str] = "attention"
    choosable: ClassVar[bool] = True     # a tuning table (or the caller) may choose it for a call
    by_choice: ClassVar[bool] = False    # runs only where chosen, never by the preference order
    table_path: ClassVar[str] = "kernel"  # the path of its tuning-table cells ("dequant": no launch config)
    float_queries: ClassVar[bool] = False  # takes the float queries only, not Q's codes with q_scale

    @classmethod
    def can_run(cls, call: AttentionCall, device: Device | None) -> str | None:
        if cls.float_queries and call.q == "codes":
            return "it takes the float queries, not Q's codes (q_scale): pass q itself"
        return super().can_run(call, device)

    @classmethod
    def refuses(cls, call: AttentionCall) -> str | None:
        return None

    @classmethod
    def options(cls, D: int, Tq: int, p_block: int) -> list:
        """The launch configurations worth timing for a call (None: the kernel's own)."""
        return [None]

    @classmethod
    def configure(cls, call: AttentionCall, config) -> Any:
        """The launch configuration it runs `call` with, given the caller's or a table's (or None)."""
        return None

    @classmethod
    def config_from_cell(cls, cell: dict) -> Any:
        """A tuning-table cell's config (its "kernel" entry removed) as `configure` takes it."""
        return None

    @classmethod
    def cell(cls, config) -> tuple[str, dict | None]:
        """The tuning table's (path, config) for this kernel run under `config` (what config_from_cell reads)."""
        if cls.table_path != "kernel":
            return cls.table_path, None
        return "kernel", dict({"kernel": cls.name}, **({} if config is None else vars(config)))

    @classmethod
    def label(cls, config) -> str:
        """What last_path() records for a run under `config`."""
        return cls.name

    @classmethod
    def apply(cls, q: torch.Tensor, k, v, spec: ar.AttnSpec, *, q_scale: torch.Tensor | None,
              out_dtype: torch.dtype, config) -> torch.Tensor:
        raise NotImplementedError(f"{cls.__name__} must implement apply")


class SplitKV(AttentionKernel):
    name = "split_kv"
    choosable = False
    summary = "flash-decoding: the keys split across programs so a decode step fills the GPU"

    @classmethod
    def refuses(cls, call):
        rows = call.G * call.Tq
        if rows > SPLIT_KV_MAX_ROWS:
            return (f"{call.G} query heads x {call.Tq} tokens = {rows} rows per KV head; its tile holds "
                    f"{SPLIT_KV_MAX_ROWS}")
        if not call.q_exact:
            return "Q must be codes with a scale (spec.q_format) or bf16"
        for op, name in ((call.k, "k"), (call.v, "v")):
            if op.kind not in ("bf16", "tensor", "head", "token"):
                return f"{name}: a {op.kind} cache (it takes bf16, or codes scaled per tensor / head / token)"
        return None

    @classmethod
    def apply(cls, q, k, v, spec, *, q_scale, out_dtype, config):
        from lowbit.ops.triton.attention_decode import split_kv_attention    # optional: triton
        return split_kv_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype)


def _q_codes(q: torch.Tensor, spec: ar.AttnSpec, q_scale: torch.Tensor | None):
    """(Q's code values, their scale) for the tile kernels, which take Q quantized on the host."""
    if q_scale is None and spec.q_format is not None:
        return ar.quantize_q_parts(q, spec.q_format)
    return q, q_scale


def _prefill_module():
    from lowbit.ops.triton import attention_prefill    # optional: triton
    return attention_prefill


class Prefill(AttentionKernel):
    name = "prefill"
    summary = "tensor-core tiles (FlashAttention-2's layout), one tiling per PrefillConfig"

    @classmethod
    def refuses(cls, call):
        return prefill_refusal(call.q_exact, call.k, call.v, call.spec)

    @classmethod
    def options(cls, D, Tq, p_block):
        return _prefill_module().prefill_candidates(D, Tq, p_block)

    @classmethod
    def configure(cls, call, config):
        return config or _prefill_module().default_config(call.D, call.Tq, call.spec.p_block)

    @classmethod
    def config_from_cell(cls, cell):
        return _prefill_module().PrefillConfig(**cell) if cell else None

    @classmethod
    def label(cls, config):
        return f"{cls.name}[{config}]"

    @classmethod
    def apply(cls, q, k, v, spec, *, q_scale, out_dtype, config):
        q, q_scale = _q_codes(q, spec, q_scale)
        return _prefill_module().prefill_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype,
                                                   config=config)


class Flash(AttentionKernel):
    name = "flash"
    summary = "the general kernel: every cache layout (head-dim groups, float caches, float Q)"

    @classmethod
    def apply(cls, q, k, v, spec, *, q_scale, out_dtype, config):
        from lowbit.ops.triton.attention import flash_attention    # optional: triton
        q, q_scale = _q_codes(q, spec, q_scale)
        return flash_attention(q, k, v, spec, q_scale=q_scale, out_dtype=out_dtype)


class SdpaDequant(AttentionKernel):
    name = "sdpa"
    by_choice = True
    table_path = "dequant"
    float_queries = True
    triton = False
    summary = "torch SDPA in bf16 over the dequantized cache (not lowbit's P-quantized arithmetic)"

    @classmethod
    def apply(cls, q, k, v, spec, *, q_scale, out_dtype, config):
        return sdpa_attention(q, k, v, spec, out_dtype=out_dtype)


ATTENTION = Registry("attention", [SplitKV, Prefill, Flash, SdpaDequant])


def choosable_names() -> list[str]:
    return [c.name for c in ATTENTION if c.choosable]


def _choosable(name: str) -> type[AttentionKernel]:
    found = [c for c in ATTENTION if c.choosable and c.name == name]
    if not found:
        raise ValueError(f"attention kernel choice must be one of {choosable_names()} (the kernels a tuning table "
                         f"or the caller may choose), got {name!r}")
    return found[0]


@tuning.per_table
def choose(call: AttentionCall, device: Device | None = None, chosen: str | None = None,
           strict: bool = True) -> Choice:
    """The kernel for `call` on `device` (None: the call's facts only): the first class of ATTENTION that
    can run it, skipping `by_choice` classes; with `chosen` (a choosable class's name), that class
    wherever no unchoosable class ahead of it runs the call. A chosen class that cannot run the call:
    ValueError with the reason (strict: the caller chose it), else it is recorded as refused and the
    preference order decides (a tuning table chose it)."""
    pick = None if chosen is None else _choosable(chosen)
    refused = []
    for cls in ATTENTION:
        if pick is not None and cls.choosable and cls is not pick:
            refused.append((cls.name, f"{pick.name!r} was chosen for this call"))
            continue
        if pick is None and cls.by_choice:
            refused.append((cls.name, "it runs only where a tuning table or the caller chooses it"))
            continue
        why = cls.can_run(call, device)
        if why is None:
            return Choice(cls, tuple(refused))
        if cls is pick:
            if strict:
                alts = [c.name for c in ATTENTION if c.choosable and c is not pick and c.can_run(call, device) is None]
                raise ValueError(f"attention kernel {pick.name!r} cannot run this call: {why}; choose "
                                 f"{' or '.join(map(repr, alts)) or 'another backend'} for it")
            rest = choose(call, device)
            return Choice(rest.kernel, ((pick.name, f"chosen by the tuning table, but {why}"),) + rest.refused)
        refused.append((cls.name, why))
    return Choice(None, tuple(refused))


def table_choice(call: AttentionCall) -> tuple[str | None, Any]:
    """A tuning table's (kernel name, launch config) for a call, or (None, None) where it leaves the
    choice to the preference order. Cells are keyed by (kind, head_dim, GQA group, bucket of Tq): a
    cell with a config names its kernel ("kernel"; without one, the prefill kernel's tiles), one
    without names the class whose table_path is the cell's path ("kernel": the kernel's default)."""
    path, cfg = tuning.choose("attention", call.kind, call.D, call.G, call.Tq)
    if cfg is None:
        if path == "kernel":
            return None, None
        by_path = [c for c in ATTENTION if c.choosable and c.table_path == path]
        if not by_path:
            raise ValueError(f"tuning table: an attention cell with path {path!r} names no attention kernel; "
                             "re-run `lowbit tune`")
        return by_path[0].name, None
    cfg = dict(cfg)
    cls = _choosable(cfg.pop("kernel", Prefill.name))
    return cls.name, cls.config_from_cell(cfg)


def resolve(call: AttentionCall, kernel: str | None = None, config=None,
            device: Device | None = None) -> tuple[Choice, Any]:
    """(the Choice for `call`, the launch config its kernel runs with). kernel: the caller's choice (a
    choosable class's name, refused with the reason where it cannot run the call); without kernel and
    config, a call of more than one query token takes a tuning table's cell where there is one."""
    strict = kernel is not None
    if kernel is None and config is None and call.Tq > 1:
        kernel, config = table_choice(call)
    choice = choose(call, device, kernel, strict)
    return choice, None if choice.kernel is None else choice.kernel.configure(call, config)


def prefill_options(D: int, Tq: int, p_block: int = 64) -> list[tuple[str, Any]]:
    """Every (kernel name, config) a tuning table may choose for a call at head_dim D, Tq query tokens
    and P block p_block: each choosable class under each of its `options`."""
    return [(cls.name, c) for cls in ATTENTION if cls.choosable for c in cls.options(D, Tq, p_block)]
