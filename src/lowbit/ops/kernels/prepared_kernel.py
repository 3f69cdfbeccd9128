"""The protocol of a dense prepared kernel (what `lowbit.ops.prepared` runs for a QuantLinear).

A `PreparedKernel` lays one layer's weight out once (`prepare` -> `Prepared`: the tensors and a
`Spec` of plain values naming the class) and applies it per call (`apply(spec, x2, ops, bias, config)`).
Where the tuning table may send some batch sizes to another path over the same layout (the weight
dequantized into a scratch buffer + the bf16 GEMM), that path is its own class, the kernel's
`dequant`; `for_rows(spec, M)` is the table's answer as a class and the tile configuration.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import ClassVar

import torch

from lowbit.ops import tuning
from lowbit.ops.kernels.base import Kernel
from lowbit.quantize import QTensor
from lowbit.scheme import QuantScheme

ACT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Spec:
    """Everything the forward needs besides tensors; hashable, and round-trips through JSON
    (the custom op takes it as a string)."""
    kind: str
    N: int
    K: int
    act_mode: str | None = None     # w8a8: "int8" | "int8_asym" | "fp8_e4m3fn" | "scheme" (per-tensor / static)
    act: str | None = None          # JSON of the activation QuantScheme where the forward needs it
    w4kind: str | None = None       # w4a16 / fp4: "int4" | "uint4" | "mxfp4" | "nvfp4"
    group: int = 0
    chunk: int = 0
    layout: str = "planar_chunks"   # w4a16: the W4Weight layout of "packed" (prepare_w4's choice)
    fp4_exp_offset: int | None = None  # MXFP4 pairs: W4Weight.fp4_exp_offset (the folded scales' D)
    operands: tuple[str, ...] = ()  # names of the prepared tensors, in the op's order
    kernel: str = ""                # the PreparedKernel class (its registry name) that laid the layer out
    graphable: bool = False         # its launches never synchronise with the host (capturable)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @property
    def act_scheme(self) -> QuantScheme | None:
        return None if self.act is None else _scheme(self.act)


@functools.lru_cache(maxsize=None)
def spec_from_json(text: str) -> Spec:
    d = json.loads(text)
    d["operands"] = tuple(d["operands"])
    return Spec(**d)


@functools.lru_cache(maxsize=None)
def _scheme(text: str) -> QuantScheme:
    return QuantScheme.from_dict(json.loads(text))


def act_json(act_scheme: QuantScheme | None) -> str | None:
    return None if act_scheme is None else json.dumps(act_scheme.to_dict(), sort_keys=True)


@dataclass
class Prepared:
    spec: Spec
    tensors: dict[str, torch.Tensor]   # name -> tensor, in spec.operands order


def row_vector(scale: torch.Tensor, N: int) -> torch.Tensor:
    """A per-channel ([N, 1]) or per-tensor scale as a contiguous fp32 [N] vector."""
    s = scale.detach().to(torch.float32).reshape(-1)
    return (s.expand(N) if s.numel() == 1 else s).contiguous()


class PreparedKernel(Kernel):
    """A kernel of the prepared fast path. Subclasses implement `refuses`, `prepare` and `apply`."""
    dequant: ClassVar[type[PreparedKernel] | None] = None   # the table's "dequant" path over this layout
    # other table paths over the same layout (path name -> class; its usable() says whether it runs here)
    alternatives: ClassVar[dict[str, type[PreparedKernel]]] = {}
    dtypes: ClassVar[tuple[torch.dtype, ...]] = ACT_DTYPES    # activation dtypes it takes
    bf16_path: ClassVar[bool] = False     # a dequant class whose apply is its kernel's with the bf16 GEMM
    # rows per tile of its layout, the last tile zero-padded: layers that share one input
    # (lowbit.nn.shared_input) concatenate their operands only where each but the last fills its tiles
    row_tile: ClassVar[int] = 1

    @classmethod
    def prepare(cls, weight_q: QTensor, act_scheme: QuantScheme | None,
                static_scale: torch.Tensor | None) -> Prepared:
        """The layer's operands in this kernel's layout (once); `Refused` when its data does not fit."""
        raise NotImplementedError

    @staticmethod
    def apply(spec: Spec, x2: torch.Tensor, ops: dict[str, torch.Tensor], bias: torch.Tensor | None,
              config) -> torch.Tensor:
        """out [M, N] in x2's dtype for x2 [M, K]; config: the tuning table's tiles (None: the default)."""
        raise NotImplementedError

    @classmethod
    def input_dtypes(cls, spec: Spec) -> tuple[torch.dtype, ...]:
        """Activation dtypes the kernel takes (others run QuantLinear's exact path)."""
        return cls.dtypes

    @classmethod
    def graph_safe(cls, spec: Spec) -> bool:
        """Whether its launches never synchronise with the host (a capture that meets a sync fails and
        leaves the device in an error state): decode calls then replay recorded launches or a graph."""
        return False

    @classmethod
    def spec(cls, kind: str, N: int, K: int, operands, **fields) -> Spec:
        """The Spec naming this class (graph_safe read once, here)."""
        s = Spec(kind, N, K, operands=tuple(operands), kernel=cls.name, **fields)
        return Spec(**{**s.__dict__, "graphable": cls.graph_safe(s)})

    @classmethod
    def for_rows(cls, spec: Spec, M: int) -> tuple[type[PreparedKernel], object]:
        """(the class that runs M rows, its tile configuration or None): the tuning table's path for
        this layer kind, shape and bucket (lowbit.ops.tuning.choose) mapped onto classes."""
        path, cfg = tuning.choose("linear", tuning.kind_key(spec), spec.N, spec.K, M)
        if path == "dequant" and cls.dequant is not None:
            return cls.dequant, cfg
        alt = cls.alternatives.get(path)
        if alt is not None and alt.usable() is None:
            return alt, cfg
        # the kernel; another path's configuration is not its tiles (a path this machine cannot run -- no
        # library, an older torch -- or one this kind does not have: the kernel under its default tiles)
        return cls, (cfg if path == "kernel" else None)

    @classmethod
    def usable(cls) -> str | None:
        """Why this class cannot run on this machine though its layer's schemes fit (None: it can)."""
        return None
