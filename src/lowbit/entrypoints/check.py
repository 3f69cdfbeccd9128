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
_FLOATS = ("float16", "bfloat16", "float32", "float64")


class BadCheckFile(ValueError):
    """A `lowbit check` input that cannot be checked (lowbit.entrypoints.main prints it, exit status 2)."""


def _scheme(path, meta: dict, key: str):
    import lowbit as lb
    text = meta.get(key)
    if text is None or text.strip() in ("", "none", "null"):
        return None
    text = text.strip()
    try:
        if text.startswith("{"):
            return lb.QuantScheme.from_json(text)
        return lb.get_preset(text)
    except (ValueError, TypeError, KeyError) as e:
        raise BadCheckFile(f"{path}: metadata {key} is neither a QuantScheme JSON nor a preset name ({e})") from e


def read_check_file(path: str) -> tuple[dict, dict]:
    """({name: tensor} for out, x, w (, bias), metadata) of a `lowbit check` file, everything
    validated: a safetensors file (lowbit's own reader: no pickle, no memory map, every offset
    checked), the three tensors present, floating point, 2-D, shapes that agree."""
    from lowbit.io.st_format import CheckpointError, TensorReader
    try:
        with TensorReader(path) as r:
            meta = r.metadata
            missing = sorted({"out", "x", "w"} - set(r.keys()))
            if missing:
                raise BadCheckFile(f"{path}: missing tensor(s) {missing}; the file needs out [M, N], x [M, K], "
                                   "w [N, K] (and optionally bias [N])")
            t = {k: r.get(k) for k in _TENSORS if k in r.keys()}
    except CheckpointError as e:
        raise BadCheckFile(str(e)) from e
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BadCheckFile(f"{path}: the header's __metadata__ must map strings to strings")
    for k, v in t.items():
        if str(v.dtype).removeprefix("torch.") not in _FLOATS:
            raise BadCheckFile(f"{path}: tensor {k} is {v.dtype}; store it as float32 (or float16 / bfloat16 / "
                               "float64)")
        want = 1 if k == "bias" else 2
        if v.ndim != want or 0 in v.shape:
            raise BadCheckFile(f"{path}: tensor {k} has shape {list(v.shape)}; it must be {_TENSORS[k]}, not empty")
    (m, n), (mx, k), (nw, kw) = t["out"].shape, t["x"].shape, t["w"].shape
    if (mx, nw, kw) != (m, n, k) or ("bias" in t and t["bias"].shape[0] != n):
        got = ", ".join(f"{name} {list(v.shape)}" for name, v in t.items())
        raise BadCheckFile(f"{path}: shapes disagree ({got}); out must be [M, N], x [M, K], w [N, K], bias [N]")
    return t, meta


def _kind(path: str) -> str | None:
    from lowbit.io.st_format import CheckpointError, TensorReader
    try:
        with TensorReader(path) as r:
            meta = r.metadata
    except CheckpointError as e:
        raise BadCheckFile(str(e)) from e
    return meta.get("kind") if isinstance(meta, dict) else None


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
        return check_grouped.run_recipe(args)
    if not args.path:
        raise ValueError("nothing to check: give a safetensors file, or --grouped RECIPE to check lowbit's grouped "
                         "kernel")
    kind = _kind(args.path)
    if kind == "attention":     # lowbit.entrypoints.check_attention's file layout
        from lowbit.entrypoints.check_attention import run as run_attention
        return run_attention(args.path)
    if kind == "grouped":
        return check_grouped.run_file(args.path, _scheme, args.accumulator, BadCheckFile)
    t, meta = read_check_file(args.path)
    if getattr(args, "probe", None):
        _use_probe(args.probe)
    undeclared = [k for k in ("x_scheme", "w_scheme") if k not in meta]
    if undeclared:
        raise BadCheckFile(f"{args.path}: declare the schemes: metadata has no {' and '.join(undeclared)}; set "
                           f"{' and '.join(undeclared)} to a preset name (e.g. int8_token / int8_channel), a "
                           f"QuantScheme JSON, or \"none\" for a side the kernel does not quantize "
                           f"(safetensors: save_file(..., metadata={{'x_scheme': ..., 'w_scheme': ...}}))")
    xs, ws = _scheme(args.path, meta, "x_scheme"), _scheme(args.path, meta, "w_scheme")
    acc = args.accumulator or meta.get("accumulator")
    if acc is not None and acc not in ACCUMULATORS:
        raise BadCheckFile(f"{args.path}: metadata accumulator={acc!r}; write one of {', '.join(ACCUMULATORS)}")
    if "accumulator" not in meta and not args.accumulator:
        print("note: metadata has no accumulator: the accumulator follows from the schemes")
    v = check_linear(t["out"], t["x"], t["w"], x_scheme=xs, w_scheme=ws, bias=t.get("bias"), accumulator=acc)
    print(v.report())
    return 0 if v.passed else 1
