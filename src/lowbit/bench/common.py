"""What every benchmark module shares: the environment a run records, the JSON file a run is
written to, its log line and the relative error its correctness column reports."""
from __future__ import annotations

import datetime
import json
import platform
import sys

import torch

import lowbit


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (a sanity column beside the timings, not a verification)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def environment() -> dict:
    import numpy

    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, numpy=numpy.__version__,
               command="lowbit " + " ".join(sys.argv[1:]))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["lowbit"] = lowbit.__version__
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, compute_capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   gpu_memory_GiB=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def write_run(path: str, env: dict, rows: list[dict], **extra) -> None:
    """A run's JSON file: {"environment": env, **extra, "rows": rows} (the reports redraw from it)."""
    with open(path, "w") as f:
        json.dump(dict(environment=env, **extra, rows=rows), f, indent=1, default=str)
