"""`lowbit audit`: a conformance table of every linear kernel on this machine (verify/audit.py), and
one of every grouped (MoE) GEMM (verify/audit_grouped.py).

    lowbit audit                                  # all kernels found, all cases, table on stdout
    lowbit audit --only triton --json a.json --png a.png
    lowbit audit --kernel mypkg.kern:w8a8 --x-scheme int8_token --w-scheme int8_channel
    lowbit audit --attention                      # the attention kernels (verify/audit_attention.py)
Exit status 0 when every cell that ran passed (or got the verdict its row documents: the bf16 SDPA
baseline's numerical rounding), 1 when some other cell is numerical / logic / error.
"""
from __future__ import annotations

import json
import os
import re
import sys

import torch


def register(parser) -> None:
    parser.add_argument("--kernel", action="append", default=[],
                        help="MODULE:FUNCTION of your kernel, called as fn(xq, wq, bias) -> out [M, N] "
                             "(QTensors from lowbit.quantize; repeatable)")
    parser.add_argument("--x-scheme", help="preset or QuantScheme JSON of x for --kernel (absent: unquantized)")
    parser.add_argument("--w-scheme", help="preset or QuantScheme JSON of w for --kernel (absent: unquantized)")
    parser.add_argument("--accumulator", help="what --kernel accumulates in (default: int32 for int x int, else fp32)")
    parser.add_argument("--only", help="run only kernels whose name contains this text as whole words "
                                       "('torch' picks torch._int_mm, not torchao's rows)")
    parser.add_argument("--no-builtin", action="store_true", help="audit only the --kernel functions")
    parser.add_argument("--case", action="append", default=[], help="run only this case (repeatable)")
    parser.add_argument("--attention", action="store_true",
                        help="audit the attention kernels (lowbit's torch path and Triton kernel with fp8 / int8 KV, "
                             "torch SDPA in fp32 and bf16) with check_attention, instead of the linear kernels")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case inputs (default 0)")
    parser.add_argument("--json", help="write the cells (verdict, cause, detail, timing) to this JSON file")
    parser.add_argument("--png", help="write the table as a coloured grid to this PNG file")


def _scheme(text):
    import lowbit as lb
    if not text:
        return None
    text = text.strip()
    return lb.QuantScheme.from_json(text) if text.startswith("{") else lb.get_preset(text)


def _describe(s) -> dict:
    if hasattr(s, "kv_scheme"):      # an attention kernel (verify/audit_attention.AttnKernel)
        return {"name": s.name, "kv_scheme": str(s.kv_scheme) if s.kv_scheme else "unquantized",
                "q_format": s.spec.q_format, "p_format": s.spec.p_format, "p_block": s.spec.p_block,
                "dtype": str(s.dtype), "out_dtype": str(s.out_dtype), "note": s.note}
    return {"name": s.name, "x_scheme": str(s.x_scheme), "w_scheme": str(s.w_scheme),
            "accumulator": s.accumulator, "note": s.note}


def run(args) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":   # the Triton kernels run in the interpreter; set before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from lowbit.ops.dispatch import have_triton
    from lowbit.verify import audit as au
    from lowbit.verify import audit_grouped as ag

    triton_ok = have_triton()
    gspecs: list = []
    if args.attention:
        if args.kernel or args.no_builtin:
            raise ValueError("--attention audits lowbit's and torch's attention kernels; --kernel / --no-builtin "
                             "take linear kernels: drop them (check your attention kernel with `lowbit check`)")
        from lowbit.verify import audit_attention as aa
        specs, cases, run_all = aa.discover(triton_ok), aa.CASES, aa.audit
    else:
        specs = [] if args.no_builtin else au.discover(device, triton_ok)
        gspecs = [] if args.no_builtin else ag.discover(device, triton_ok)
        for k in args.kernel:
            specs.append(au.user_kernel(k, _scheme(args.x_scheme), _scheme(args.w_scheme), args.accumulator))
        cases, run_all = au.CASES, au.audit
    if args.only:
        word = re.compile(rf"(?<!\w){re.escape(args.only)}(?!\w)")
        specs = [s for s in specs if word.search(s.name)]
        gspecs = [s for s in gspecs if word.search(s.name)]
    gcases = ag.CASES
    if args.case:
        names = {c.name for c in cases} | {c.name for c in gcases}
        unknown = [c for c in args.case if c not in names]
        if unknown:
            raise ValueError(f"--case {unknown[0]!r} is not a case; choose from {sorted(names)}")
        cases = [c for c in cases if c.name in args.case]
        gcases = [c for c in gcases if c.name in args.case]
    if not (specs and cases) and not (gspecs and gcases):
        raise ValueError("no kernel to audit: drop --only / --no-builtin / --case or pass --kernel MODULE:FUNCTION")
    env = au.environment(device)
    print(f"lowbit audit on {env.get('gpu', 'CPU')} (torch {env['torch']}"
          f"{', Triton interpreter' if env['triton_interpreter'] else ''}): {len(specs)} kernels x {len(cases)} cases, "
          f"{len(gspecs)} grouped kernels x {len(gcases)} cases", file=sys.stderr)
    progress = lambda s: print(s, file=sys.stderr)  # noqa: E731
    cells = run_all(specs, cases, device=device, seed=args.seed, progress=progress) if specs else []
    gcells = ag.audit(gspecs, gcases, device=device, seed=args.seed, progress=progress) if gspecs else []
    for part in (cells, gcells):
        if part:
            print(au.table(part))
    for c in cells + gcells:
        if c.verdict in ("numerical", "logic", "error"):
            what = " (expected of this row)" if c.expected else ""
            print(f"\n{c.kernel} / {c.case}: {c.verdict}{what}: {c.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "cases": [c.name for c in cases],
                       "grouped_cases": [c.name for c in gcases],
                       "kernels": [_describe(s) for s in specs], "grouped_kernels": [_describe(s) for s in gspecs],
                       "cells": [c.__dict__ for c in cells + gcells]}, f, indent=1)
    if args.png:
        au.plot(cells + gcells, args.png, f"lowbit audit: {env.get('gpu', 'CPU')}")
    return 0 if all(c.verdict in ("pass", "n/a") or c.expected for c in cells + gcells) else 1
