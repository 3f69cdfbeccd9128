"""`lowbit check out.safetensors`: verify a kernel's output written by any language.

The file holds tensors `out` [M, N], `x` [M, K], `w` [N, K] and optionally `bias` [N]; its
metadata (string -> string) may hold `x_scheme` / `w_scheme` (QuantScheme JSON or a preset
name; absent = that side unquantized) and `accumulator` ("int32" | "fp32" | "fp8_fast" | "fp16" | "bf16").
Exit status 0 when the check passes, 1 when it fails, 2 on a bad file.
"""
from __future__ import annotations

import sys

from lowbit.verify.tolerance import ACCUMULATORS


def register(parser) -> None:
    parser.add_argument("path", help="safetensors file with out, x, w (, bias) and schemes in metadata")
    parser.add_argument("--accumulator", choices=list(ACCUMULATORS),
                        help="what the kernel accumulates in (overrides the file's metadata)")


def _scheme(meta: dict, key: str):
    import lowbit as lb
    text = meta.get(key)
    if text is None or text in ("", "none", "null"):
        return None
    text = text.strip()
    if text.startswith("{"):
        return lb.QuantScheme.from_json(text)
    return lb.get_preset(text)


def run(args) -> int:
    from safetensors import safe_open

    from lowbit.verify import check_linear

    try:
        with safe_open(args.path, framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            missing = {"out", "x", "w"} - names
            if missing:
                print(f"{args.path}: missing tensor(s) {sorted(missing)}; the file needs out [M, N], x [M, K], "
                      f"w [N, K] (and optionally bias [N])", file=sys.stderr)
                return 2
            t = {k: f.get_tensor(k) for k in names & {"out", "x", "w", "bias"}}
        xs, ws = _scheme(meta, "x_scheme"), _scheme(meta, "w_scheme")
    except (OSError, ValueError) as e:
        print(f"{args.path}: {e}", file=sys.stderr)
        return 2
    acc = args.accumulator or meta.get("accumulator")
    v = check_linear(t["out"], t["x"], t["w"], x_scheme=xs, w_scheme=ws, bias=t.get("bias"), accumulator=acc)
    print(v.report())
    return 0 if v.passed else 1
