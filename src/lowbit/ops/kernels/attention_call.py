"""The facts of an attention call the attention kernels are chosen by (lowbit.ops.kernels.attention),
and the one refusal a kernel's launcher shares with its class.

`AttentionCall` names a call: query tokens, GQA group, head_dim, how Q arrives, each cache operand's
layout (`CacheOperand`) and the AttnSpec; `kind_key` is the tuning table's name for its kind.
`prefill_refusal` is why the tensor-core prefill kernel cannot run a call: its class asks it, and its
launcher (lowbit.ops.triton.attention_prefill) refuses with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.ops import attention_reference as ar
from lowbit.ops.kv_quant import KVQuant, KVScheme

SPLIT_KV_MAX_ROWS = 64          # G * Tq rows per KV head the split-KV kernel holds in one tile
CODE_FORMATS = ("fp8_e4m3fn", "int8")     # the code formats the tensor-core prefill kernel reads (K, V, P)
Q_MODES = ("codes", "quantized", "bf16", "float")


@dataclass(frozen=True)
class CacheOperand:
    """How one cache operand (K or V) is stored: `kind` ('bf16', 'float', or its KV scheme's granularity:
    'tensor', 'head', 'token', 'group'), `format` (its codes' element format; None for float values) and,
    for float values, their `dtype`."""
    kind: str
    format: str | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, t) -> CacheOperand:
        """The operand of a KVQuant or a float [B, H, T, D] tensor."""
        if isinstance(t, KVQuant):
            return cls.of_scheme(t.scheme)
        return cls("bf16" if t.dtype == torch.bfloat16 else "float", None, t.dtype)

    @classmethod
    def of_scheme(cls, scheme: KVScheme | None) -> CacheOperand:
        """A cache stored by KVScheme `scheme` (None: bf16 values)."""
        if scheme is None:
            return cls("bf16", None, torch.bfloat16)
        return cls(scheme.granularity, scheme.format)


def kv_kind(t) -> str:
    """How a cache operand is stored, the fact attention kernels are chosen by: 'bf16', 'float'
    (fp32 / fp16 values), or its KV scheme's granularity ('tensor', 'head', 'token', 'group')."""
    return CacheOperand.of(t).kind


def kind_key(k: CacheOperand, v: CacheOperand, spec: ar.AttnSpec) -> str:
    """The tuning table's name for an attention call's kind: cache layouts, Q and P formats, P block."""
    return f"{k.kind}/{v.kind}/q-{spec.q_format}/p-{spec.p_format}/{spec.p_block}"


@dataclass(frozen=True)
class AttentionCall:
    """The facts of an attention call the kernels decide on: Tq query tokens per head, G query heads
    per KV head, head_dim D, how Q arrives (`q`: "codes" -- code values with their scale --, "quantized"
    -- float, quantized per spec.q_format by the kernel --, "bf16" or "float" values), the two cache
    operands and the AttnSpec."""
    Tq: int
    G: int
    D: int
    q: str
    k: CacheOperand
    v: CacheOperand
    spec: ar.AttnSpec

    def __post_init__(self):
        if self.q not in Q_MODES:
            raise ValueError(f"AttentionCall: q must be one of {Q_MODES}, got {self.q!r}")

    @classmethod
    def of(cls, q: torch.Tensor, k, v, spec: ar.AttnSpec, q_scale: torch.Tensor | None = None) -> AttentionCall:
        """The call attention_triton(q, k, v, spec, q_scale=q_scale) makes (shapes checked by the caller)."""
        B, Hq, Tq, D = q.shape
        mode = ("codes" if q_scale is not None else "quantized" if spec.q_format is not None
                else "bf16" if q.dtype == torch.bfloat16 else "float")
        return cls(Tq, Hq // k.shape[1], D, mode, CacheOperand.of(k), CacheOperand.of(v), spec)

    @property
    def q_exact(self) -> bool:
        """Q is exact in a tensor-core dot: codes with a scale, or bf16 values."""
        return self.q != "float"

    @property
    def kind(self) -> str:
        return kind_key(self.k, self.v, self.spec)


def prefill_refusal(q_exact: bool, k: CacheOperand, v: CacheOperand, spec: ar.AttnSpec) -> str | None:
    """Why the tensor-core prefill kernel cannot run a call (None: it can). Every dot operand must be
    exact in fp16 / bf16 with the scales outside the dots (lowbit.ops.triton.attention_prefill)."""
    if not q_exact:
        return "Q must be codes with a scale (spec.q_format) or bf16"
    if spec.p_format not in CODE_FORMATS:
        return "P must be quantized (spec.p_format fp8_e4m3fn or int8)"
    for op, name, grans in ((k, "k", ("tensor", "head", "token")), (v, "v", ("tensor", "head"))):
        if op.format is not None:
            if op.format not in CODE_FORMATS:
                return f"{name}: {op.format} codes (the kernel takes fp8_e4m3fn or int8)"
            if op.kind not in grans:
                return f"{name}: scales per {op.kind} (the kernel takes per {' / '.join(grans)})"
        elif op.dtype != torch.bfloat16:
            return f"{name}: an unquantized {op.dtype} cache (the kernel takes bf16)"
    return None
