"""`lowbit check out.safetensors`: verify a kernel's output written by any language.

The file holds tensors `out` [M, N], `x` [M, K], `w` [N, K] and optionally `bias` [N]; its
metadata (string -> string) must declare `x_scheme` and `w_scheme` (QuantScheme JSON, a preset name,
or "none" for a side the kernel does not quantize: a file without them is refused, since checking a
quantized kernel as an unquantized one would blame the quantization on its arithmetic) and may hold
`accumulator` ("int32" | "fp32" | "fp8_fast" | "fp16" | "bf16").
Exit status 0 when the check passes, 1 when it fails, 2 on a bad file.
A file whose metadata says kind=attention is an attention check (lowbit.entrypoints.check_attention),
kind=grouped a grouped (MoE) GEMM check; `lowbit check --grouped RECIPE` checks lowbit's own grouped
kernel (lowbit.entrypoints.check_grouped).
"""
from __future__ import annotations

from lowbit.entrypoints import check_file
from lowbit.entrypoints.check_file import BadCheckFile
from lowbit.verify.tolerance import ACCUMULATORS


def register(parser) -> None:
    parser.add_argument("path", nargs="?", help="safetensors file with out, x, w (, bias) and schemes in metadata "
                                                "(kind=attention / kind=grouped: see those checks)")
    parser.add_argument("--accumulator", choices=list(ACCUMULATORS),
                        help="what the kernel accumulates in (overrides the file's metadata)")
    parser.add_argument("--probe", metavar="PATH",
                        help="a `lowbit probe --json` table: its measured fp8 accumulators are simulated too")
    from lowbit.entrypoints import check_grouped
    check_grouped.register(parser)


_TENSORS = {"out": "[M, N]", "x": "[M, K]", "w": "[N, K]", "bias": "[N]"}


def linear_tensors(path: str, t: dict) -> dict:
    """{name: tensor} for out, x, w (, bias) of a linear check file's tensors `t`
    (lowbit.entrypoints.check_file.read), validated: present, floating point, 2-D, shapes that agree."""
    check_file.require(path, t, ("out", "x", "w"), "the file needs out [M, N], x [M, K], w [N, K] (and optionally "
                                                   "bias [N])")
    t = {k: t[k] for k in _TENSORS if k in t}
    check_file.require_float(path, t, _TENSORS, "float32 (or float16 / bfloat16 / float64)")
    for k, v in t.items():
        want = 1 if k == "bias" else 2
        if v.ndim != want or 0 in v.shape:
            raise BadCheckFile(f"{path}: tensor {k} has shape {list(v.shape)}; it must be {_TENSORS[k]}, not empty")
    (m, n), (mx, k), (nw, kw) = t["out"].shape, t["x"].shape, t["w"].shape
    if (mx, nw, kw) != (m, n, k) or ("bias" in t and t["bias"].shape[0] != n):
        got = ", ".join(f"{name} {list(v.shape)}" for name, v in t.items())
        raise BadCheckFile(f"{path}: shapes disagree ({got}); out must be [M, N], x [M, K], w [N, K], bias [N]")
    return t


def _use_probe(path: str) -> None:
    """Register a probe table's fp8 accumulators with the diagnosis (verify/accumulate.py)."""
    import json

    from lowbit.verify.accumulate import use_probe_table
    try:
        with open(path) as f:
            table = json.load(f)
        use_probe_table(table)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadCheckFile(f"{path}: not a `lowbit probe --json` table ({type(e).__name__}: {e})") from e


def run(args) -> int:
    from lowbit.entrypoints import check_grouped
    from lowbit.verify import check_linear

    if getattr(args, "grouped", None):
        if args.path:
            raise ValueError(f"give either a file ({args.path}) or --grouped {args.grouped}, not both")
        return check_grouped.check_recipe(args)
    if not args.path:
        raise ValueError("nothing to check: give a safetensors file, or --grouped RECIPE to check lowbit's grouped "
                         "kernel")
    t, meta = check_file.read(args.path)
    kind = meta.get("kind")
    if kind == "attention":     # lowbit.entrypoints.check_attention's file layout
        from lowbit.entrypoints.check_attention import run as run_attention
        return run_attention(args.path, t, meta)
    if kind == "grouped":
        return check_grouped.run_file(args.path, t, meta, args.accumulator)
    t = linear_tensors(args.path, t)
    if getattr(args, "probe", None):
        _use_probe(args.probe)
    xs, ws = check_file.schemes(args.path, meta)
    acc = args.accumulator or meta.get("accumulator")
    if acc is not None and acc not in ACCUMULATORS:
        raise BadCheckFile(f"{args.path}: metadata accumulator={acc!r}; write one of {', '.join(ACCUMULATORS)}")
    if "accumulator" not in meta and not args.accumulator:
        print("note: metadata has no accumulator: the accumulator follows from the schemes")
    return check_file.verdict(args.path, check_linear, t["out"], t["x"], t["w"], x_scheme=xs, w_scheme=ws,
                              bias=t.get("bias"), accumulator=acc)
