"""`lowbit probe [--json PATH]`: measure this GPU's matrix-multiply accumulators (verify/probe.py)
for the paths lowbit and torch use: cuBLAS fp8 through torch._scaled_mm (with and without fast
accumulation), cuBLAS bf16 / fp16 (torch.mm with float32 output), Triton's tl.dot (fp8, bf16),
and torch._int_mm's int8. The JSON table feeds `lowbit check --probe PATH`, which then simulates
the measured fp8 accumulators when it looks for a narrower accumulator than promised.
Exit status 0 when every path was measured and fitted, 1 otherwise, 2 without CUDA.

`lowbit probe --attention MODULE:FUNCTION [--attention-format fp8]`: fit an attention kernel's
Q.K^T and P.V accumulators instead (verify/probe_attention.py); FUNCTION(q, k, v, sm_scale) -> out
computes full softmax attention on inputs exact in its format (unit scales). Runs wherever the
kernel does (no CUDA needed); exit status 0 when both accumulators were fitted, 1 otherwise.
"""
from __future__ import annotations

import importlib
import json


def register(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the probe table as JSON to PATH")
    parser.add_argument("--paths", nargs="+", metavar="NAME",
                        help="measure only these paths (cublas_fp8_fast cublas_fp8 cublas_bf16 cublas_fp16 "
                             "triton_bf16 triton_fp8 int8)")
    parser.add_argument("--attention", metavar="MODULE:FUNCTION",
                        help="probe an attention kernel instead: FUNCTION(q, k, v, sm_scale) -> out, full softmax "
                             "attention over [B, H, T, D] float64 inputs exact in --attention-format, taken with "
                             "unit scales, importable from MODULE (on PYTHONPATH)")
    parser.add_argument("--attention-format", default="fp8", choices=("fp8", "fp16", "bf16"),
                        help="the attention kernel's input format (default fp8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim of the attention probe's inputs (default 128)")


def load_callable(spec: str):
    """MODULE:FUNCTION -> the callable; ValueError naming the fix when it cannot be found."""
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"--attention {spec!r}: give MODULE:FUNCTION (e.g. my_kernels:attention)")
    try:
        obj = getattr(importlib.import_module(mod), name)
    except ModuleNotFoundError as e:
        raise ValueError(f"--attention {spec!r}: module {e.name!r} is not importable; add its directory to "
                         "PYTHONPATH") from e
    except AttributeError as e:
        raise ValueError(f"--attention {spec!r}: module {mod!r} has no attribute {name!r}") from e
    if not callable(obj):
        raise ValueError(f"--attention {spec!r}: {name} is a {type(obj).__name__}, not a function")
    return obj


def _write(table: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {path}")


def run(args) -> int:
    import torch

    from lowbit.verify import probe, probe_attention

    if args.attention:
        fit = probe_attention.probe_attention(load_callable(args.attention), args.attention_format, args.head_dim)
        print(f"lowbit probe --attention {args.attention} ({args.attention_format} inputs, head dim {args.head_dim})")
        print(probe_attention.describe(fit))
        _write({"attention": args.attention, "format": args.attention_format, **fit.as_dict()}, args.json)
        return 0 if fit.qk.fitted and fit.pv.fitted else 1
    if not torch.cuda.is_available():
        print("lowbit probe: no CUDA device: the probe measures a GPU's matrix units (its fitting logic is "
              "tested on CPU against simulated accumulators: tests/verify/test_probe.py); an attention kernel "
              "given as a callable is probed anywhere: --attention MODULE:FUNCTION")
        return 2
    table = probe.measure(args.paths)
    print(probe.describe(table))
    _write(table, args.json)
    return 0 if all(r.get("fitted") for r in table["paths"].values()) else 1
