"""`lowbit probe [--json PATH]`: measure this GPU's matrix-multiply accumulators (verify/probe.py)
for the paths lowbit and torch use: cuBLAS fp8 through torch._scaled_mm (with and without fast
accumulation), cuBLAS bf16 / fp16 (torch.mm with float32 output), Triton's tl.dot (fp8, bf16),
and torch._int_mm's int8. The JSON table feeds `lowbit check --probe PATH`, which then simulates
the measured fp8 accumulators when it looks for a narrower accumulator than promised.
Exit status 0 when every path was measured and fitted, 1 otherwise, 2 without CUDA.
"""
from __future__ import annotations

import json


def register(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the probe table as JSON to PATH")
    parser.add_argument("--paths", nargs="+", metavar="NAME",
                        help="measure only these paths (cublas_fp8_fast cublas_fp8 cublas_bf16 cublas_fp16 "
                             "triton_bf16 triton_fp8 int8)")


def run(args) -> int:
    import torch

    from lowbit.verify import probe

    if not torch.cuda.is_available():
        print("lowbit probe: no CUDA device: the probe measures a GPU's matrix units (its fitting logic is "
              "tested on CPU against simulated accumulators: tests/verify/test_probe.py)")
        return 2
    table = probe.measure(args.paths)
    print(probe.describe(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r.get("fitted") for r in table["paths"].values()) else 1
