"""Run a transformers model over calibration or evaluation batches with hooks attached: the one
place that knows a batch is either a dict of forward keyword arguments or the input ids, and
that the hooks come off again even when a forward raises."""
from __future__ import annotations

from typing import Iterable

import torch


def run_batches(model: torch.nn.Module, batches: Iterable, hooks: list) -> None:
    """model(**b) or model(b) for each batch under no_grad; every handle in `hooks` (the
    RemovableHandles register_forward_hook & co. return) is removed afterwards."""
    try:
        with torch.no_grad():
            for b in batches:
                model(**b) if isinstance(b, dict) else model(b)
    finally:
        for h in hooks:
            h.remove()
