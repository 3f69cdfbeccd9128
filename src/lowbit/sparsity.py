"""2:4 structured sparsity along the last axis (K): in every group of 4 consecutive K
elements at most 2 are non-zero, the pattern NVIDIA's sparse tensor cores accelerate.

- prune_2_4(x): keep the 2 largest |x| of each group of 4, zero the other 2. Ties are
  resolved deterministically: among equal magnitudes the LOWER index is kept (stable sort).
- compress_2_4(x): x must already be 2:4 sparse. Returns (values [..., K/2], indices uint8
  [..., K/2]): for each group the two kept positions in increasing order (0..3, one index
  per value, unpacked) and their values. A group with fewer than two non-zeros fills up with
  its lowest-index zero positions, so every group stores exactly two (value, index) pairs.
- decompress_2_4(values, indices): scatter back to [..., K]; exact inverse of compress_2_4
  (a -0.0 at a dropped position comes back as +0.0, which compares equal).
Works on any real dtype (floats, and integer codes of a QTensor).
"""
from __future__ import annotations

import torch


def _groups(x: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0 or x.shape[-1] % 4:
        k = x.shape[-1] if x.ndim else "0-d"
        raise ValueError(f"{what}: the last dim (K = {k}) must be a multiple of 4 for 2:4 sparsity; "
                         "pad K with zeros to a multiple of 4 first")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{what}: x must be a real float or integer tensor, got {x.dtype}")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: x has {int((~torch.isfinite(x)).sum())} NaN/Inf values; "
                         "magnitude pruning is undefined for them, clean the input first")
    return x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4)


def mask_2_4(x: torch.Tensor) -> torch.Tensor:
    """bool mask [..., K]: True at the 2 largest |x| of each group of 4 (lower index wins ties)."""
    g = _groups(x, "mask_2_4")
    if g.dtype == torch.uint8:
        raise TypeError("mask_2_4: uint8 input has no sign-magnitude order (fp bit patterns / unsigned "
                        "codes); prune the float values (or signed int codes) instead")
    mag = g.abs()
    # stable descending sort keeps equal magnitudes in index order, so the lower index wins
    order = torch.sort(mag, dim=-1, descending=True, stable=True).indices[..., :2]
    m = torch.zeros(g.shape, dtype=torch.bool, device=x.device)
    m.scatter_(-1, order, True)
    return m.reshape(x.shape)


def prune_2_4(x: torch.Tensor) -> torch.Tensor:
    """x with all but the 2 largest-magnitude values of each group of 4 (along K) set to 0."""
    return torch.where(mask_2_4(x), x, torch.zeros((), dtype=x.dtype, device=x.device))


def is_2_4_sparse(x: torch.Tensor) -> bool:
    g = _groups(x, "is_2_4_sparse")
    return bool(((g != 0).sum(-1) <= 2).all())


def compress_2_4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [..., K/2] in x's dtype, indices uint8 [..., K/2]) of a 2:4-sparse x."""
    g = _groups(x, "compress_2_4")
    nnz = (g != 0).sum(-1)
    if bool((nnz > 2).any()):
        first = tuple(int(i) for i in (nnz > 2).nonzero()[0].tolist())
        raise ValueError(f"compress_2_4: x is not 2:4 sparse: {int((nnz > 2).sum())} group(s) of 4 hold more "
                         f"than 2 non-zeros (first: group {first}); call prune_2_4(x) first")
    # non-zeros first, then zeros, each in index order (stable sort); then order the pair by index
    keep = torch.sort((g != 0).to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :2]
    keep = torch.sort(keep, dim=-1).values
    vals = torch.gather(g, -1, keep)
    half = x.shape[-1] // 2
    return vals.reshape(*x.shape[:-1], half), keep.to(torch.uint8).reshape(*x.shape[:-1], half)


def decompress_2_4(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Inverse of compress_2_4: dense [..., 2 * values.shape[-1]]."""
    if values.shape != indices.shape or values.ndim == 0 or values.shape[-1] % 2:
        raise ValueError(f"decompress_2_4: values and indices must have the same shape [..., K/2] with an "
                         f"even last dim; got {tuple(values.shape)} and {tuple(indices.shape)}")
    if indices.dtype != torch.uint8:
        raise TypeError(f"decompress_2_4: indices must be uint8 (from compress_2_4), got {indices.dtype}")
    idx = indices.to(torch.int64).reshape(*indices.shape[:-1], -1, 2)
    if bool((idx > 3).any()) or bool((idx[..., 0] >= idx[..., 1]).any()):
        raise ValueError("decompress_2_4: each pair of indices must be two increasing positions in 0..3 "
                         "(as compress_2_4 writes them); the metadata is corrupt")
    v = values.reshape(idx.shape)
    out = torch.zeros((*idx.shape[:-1], 4), dtype=values.dtype, device=values.device)
    out.scatter_(-1, idx, v)
    return out.reshape(*values.shape[:-1], 2 * values.shape[-1])
