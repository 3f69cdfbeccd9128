"""2:4 sparse linear: out = x @ W.T (+ bias) with a 2:4-pruned weight W [N, K].

    sw = prepare_2_4(w)              # w already 2:4 sparse (lowbit.prune_2_4), at load time
    out = sparse_linear(x, sw, bias)

On CUDA the weight is converted once with torch.sparse.to_sparse_semi_structured, which runs
on cuSPARSELt (backend="cutlass" picks PyTorch's CUTLASS kernels, sm_8x only) and the
product runs on the sparse tensor cores. On the CPU -- and with backend="dense" --
the same weight is used dense: the reference twin, exact up to float accumulation order.
Nothing is pruned here: a weight that is not 2:4 sparse is an error, so the sparse and dense
paths always compute the same function.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.sparsity import is_2_4_sparse

_SPARSE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class Sparse24Weight:
    """A 2:4 sparse weight prepared for sparse_linear."""

    dense: torch.Tensor                 # [N, K], the pruned weight (reference twin)
    sparse: torch.Tensor | None         # torch SparseSemiStructuredTensor (CUDA) or None
    backend: str                        # "cusparselt" | "cutlass" | "dense"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.dense.shape)


def prepare_2_4(w: torch.Tensor, *, backend: str | None = None) -> Sparse24Weight:
    """Check that w [N, K] is 2:4 sparse along K and convert it for the sparse tensor cores.

    backend: None (CUDA -> cuSPARSELt, CPU -> dense), "dense", "cusparselt" or "cutlass"
    (PyTorch's other semi-structured implementation; it refuses GPUs other than sm_8x, e.g.
    the H200: "Supported only on GPUs with compute capability 8.x")."""
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        raise ValueError(f"prepare_2_4: w must be a 2-D [N, K] tensor, got "
                         f"{getattr(w, 'shape', type(w).__name__)}")
    if w.dtype not in _SPARSE_DTYPES:
        raise TypeError(f"prepare_2_4: w has dtype {w.dtype}; the sparse path takes bfloat16 or float16 "
                        "(convert with w.to(torch.bfloat16))")
    if not is_2_4_sparse(w):
        raise ValueError("prepare_2_4: w is not 2:4 sparse along K (some group of 4 holds more than 2 "
                         "non-zeros); prune it first with lowbit.prune_2_4(w)")
    if backend is None:
        backend = "cusparselt" if w.is_cuda else "dense"
    if backend not in ("dense", "cusparselt", "cutlass"):
        raise ValueError(f"prepare_2_4: backend must be None, 'dense', 'cusparselt' or 'cutlass', got {backend!r}")
    if backend == "dense":
        return Sparse24Weight(w.contiguous(), None, "dense")
    if not w.is_cuda:
        raise ValueError(f"prepare_2_4: backend={backend!r} needs a CUDA tensor (semi-structured sparsity "
                         "runs on NVIDIA sparse tensor cores); use backend='dense' on the CPU")
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    N, K = w.shape
    if N % 64 or K % 64:
        raise ValueError(f"prepare_2_4: semi-structured sparse weights need N and K to be multiples of 64 "
                         f"(got [{N}, {K}]); pad the layer or use backend='dense'")
    if backend == "cusparselt" and not torch.backends.cusparselt.is_available():
        raise RuntimeError("prepare_2_4: this PyTorch build has no cuSPARSELt; pass backend='cutlass' "
                           "(PyTorch's CUTLASS path runs on compute capability 8.x only) or 'dense'")
    force = SparseSemiStructuredTensor._FORCE_CUTLASS
    try:
        SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
        sp = to_sparse_semi_structured(w.contiguous())
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = force
    return Sparse24Weight(w.contiguous(), sp, backend)


def sparse_linear(x: torch.Tensor, w: Sparse24Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (w's dtype) -> out [..., N] in x's dtype."""
    if not isinstance(w, Sparse24Weight):
        raise TypeError(f"sparse_linear: w must be a Sparse24Weight (prepare_2_4(w)), got {type(w).__name__}")
    N, K = w.shape
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.shape[-1] != K:
        raise ValueError(f"sparse_linear: x has shape {tuple(getattr(x, 'shape', ()))}; its last dim must be K = {K}")
    if x.dtype != w.dense.dtype:
        raise TypeError(f"sparse_linear: x has dtype {x.dtype}, the weight {w.dense.dtype}; they must match")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"sparse_linear: bias must have shape ({N},)")
    if w.sparse is None:
        return torch.nn.functional.linear(x, w.dense, bias)
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    pad = (-M) % 8  # the semi-structured kernels take the dense operand in multiples of 8 rows
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
    out = torch.nn.functional.linear(x2, w.sparse, bias)[:M]
    return out.reshape(lead + (N,))
