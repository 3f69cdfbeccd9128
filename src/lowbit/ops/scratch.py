"""Reusable buffers for weights dequantized per call (the bf16 path the tuning table may choose):
one buffer per (shape, dtype, device), shared by every layer of that shape, so the bf16 path
costs one weight's bf16 bytes per layer shape, not per layer or per call.

A buffer is reused only on a device's default stream outside CUDA-graph capture: the layers that
share it then run one after another, each reading the buffer before the next overwrites it. On any
other stream (kernels of two streams may overlap), and while a graph is being captured (torch's
graph trees refuse a buffer that outlives the capture), each call gets a fresh buffer instead."""
from __future__ import annotations

import torch

_BUFFERS: dict = {}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor of `shape` the caller overwrites completely before reading."""
    if device.type == "cuda" and (torch.cuda.is_current_stream_capturing()
                                  or torch.cuda.current_stream(device) != torch.cuda.default_stream(device)):
        return torch.empty(shape, dtype=dtype, device=device)
    key = (tuple(shape), dtype, str(device))
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def scratch_bytes() -> int:
    """Bytes held by the reusable buffers (the bench reports them beside peak memory)."""
    return sum(b.numel() * b.element_size() for b in _BUFFERS.values())


def release() -> None:
    """Free every reusable buffer (they are made again on the next call that needs one)."""
    _BUFFERS.clear()
