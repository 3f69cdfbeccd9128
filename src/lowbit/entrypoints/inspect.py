"""`lowbit inspect DIR`: every layer's scheme and scale shapes in a compressed-tensors
checkpoint, and the serving-side failure modes that show up in the files:

- per-tensor activation scales (one scale for a whole activation: an outlier channel
  crushes every other value), in particular when other layers use per-token scales;
- scale shapes that contradict the declared scheme (a "per-channel" weight with a single
  scale is a silent per-tensor fallback);
- asymmetric schemes without zero points (and zero points a symmetric scheme cannot use);
- quantized logits (lm_head), embeddings, norms or output activations (the residual
  stream), and layers that config.json targets but the files store unquantized;
- q/k/v or gate/up of one block with different schemes (vLLM fuses them into one GEMM);
- loaders that cannot read the checkpoint (lowbit.recipes.loaders: transformers, vLLM), one
  warning per loader with the recipes it reads, decided from config.json's groups.

Only safetensors headers are read (plus the few-byte ``weight_shape`` tensors), so
inspecting a checkpoint of any size is instant. Works on checkpoints from any tool.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lowbit.pipelines.checkpoint import read_json, check_qc_types
from lowbit.recipes.loaders import add_form, loader_warnings
from lowbit.io.st_format import CheckpointError, TensorReader, checkpoint_files, read_header

ERROR, WARN, INFO = "error", "warning", "info"
_HIGH_PRECISION = re.compile(r"(^|\.)(lm_head|embed_tokens|wte|wpe|embed_in|embed_out|word_embeddings|"
                             r"[a-z_]*norm[a-z_0-9]*|ln_f|ln_\d+)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")       # a per-expert Linear (<block>.experts.<e>.<proj>)
_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


@dataclass
class Finding:
    level: str      # error | warning | info
    layer: str
    code: str       # short machine-readable tag
    message: str


@dataclass
class LayerInfo:
    name: str
    group: str | None
    format: str | None
    weight: str
    act: str
    shape: list | None                      # [N, K] of the dense weight
    tensors: dict = field(default_factory=dict)  # local name -> "dtype [shape]"


@dataclass
class Report:
    path: str
    format: str | None
    layers: list
    findings: list
    ignore: list = field(default_factory=list)     # quantization_config.ignore, as written
    dense_linears: list | None = None              # Linears of the architecture stored unquantized (None: unknown)

    @property
    def errors(self) -> list:
        return [f for f in self.findings if f.level == ERROR]


def describe_args(a: dict | None) -> str:
    if a is None:
        return "-"
    strat = a.get("strategy") or ("tensor" if a.get("group_size") is None else "group")
    gran = f"{strat}/{a['group_size']}" if a.get("group_size") not in (None, -1) else strat
    if a.get("block_structure"):
        gran = f"block {a['block_structure'][0]}x{a['block_structure'][1]}"
    bits = f"{a.get('type', 'int')}{a.get('num_bits', 8)}"
    dyn = a.get("dynamic", False)
    kind = "dynamic" if dyn is True else ("dynamic-local" if dyn == "local" else "static")
    sym = "" if a.get("symmetric", True) else " asym"
    sd = {"torch.uint8": " e8m0-scale", "torch.float8_e4m3fn": " fp8-scale"}.get(str(a.get("scale_dtype")), "")
    return f"{bits} {gran}{sym} {kind}{sd}"


def _expected_scale_shape(a: dict, n: int, k: int) -> list | None:
    strat = a.get("strategy")
    if strat == "tensor":
        return [1]
    if strat == "channel":
        return [n, 1]
    if strat in ("group", "tensor_group") and a.get("group_size"):
        return [n, -(-k // a["group_size"])]
    if strat == "block" and a.get("block_structure"):
        br, bc = a["block_structure"]
        return [-(-n // br), -(-k // bc)]
    return None


def _match(target: str, name: str) -> bool:
    return re.match(target[3:], name) is not None if target.startswith("re:") else target == name


def inspect_checkpoint(path: str | Path) -> Report:
    """Read config.json and the safetensors headers of `path`; return the Report.
    Raises CheckpointError when the directory is not a readable checkpoint at all."""
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{d} has no config.json; is it a checkpoint directory?")
    cfg = read_json(cfg_path, "the model config with quantization_config")
    files = checkpoint_files(d)
    headers = {p: read_header(p)[0] for p in set(files.values())}
    info = {n: headers[p][n] for n, p in files.items()}  # name -> (dtype, shape, begin, end)
    findings: list[Finding] = []
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        if qc is None:
            raise CheckpointError(f"{cfg_path} has no quantization_config: {d} is a float (unquantized) checkpoint; "
                                  "quantize it with `lowbit quantize --model DIR`")
        raise CheckpointError(f"{cfg_path}: quantization_config is not compressed-tensors (quant_method "
                              f"{None if not isinstance(qc, dict) else qc.get('quant_method')!r}); lowbit inspect "
                              "reads compressed-tensors checkpoints")
    groups, ignore = check_qc_types(qc, str(d))
    top_fmt = qc.get("format")

    # layers with quantized tensors, by module prefix
    qkeys = ("weight_scale", "weight_packed")
    qlayers = sorted({n.rpartition(".")[0] for n in info if n.rpartition(".")[2] in qkeys}, key=natural_key)
    by_layer: dict[str, dict] = {}
    for n, (dt, shape, _, _) in info.items():
        mod, _, local = n.rpartition(".")
        if mod in qlayers:
            by_layer.setdefault(mod, {})[local] = (dt, shape)

    layers, act_strats, forms = [], {}, {}
    for name in qlayers:
        t = by_layer[name]
        exact = [g for g, v in groups.items() if any(_match(x, name) for x in v.get("targets", []))]
        generic = [g for g, v in groups.items() if "Linear" in v.get("targets", [])]
        gname = (exact or generic or [None])[0]
        g = groups.get(gname) or {}
        w, a = g.get("weights"), g.get("input_activations")
        fmt = g.get("format") or top_fmt
        if gname is None:
            findings.append(Finding(ERROR, name, "untargeted", "has quantized tensors but no config group targets it"))
        if any(_match(x, name) for x in ignore):
            findings.append(Finding(ERROR, name, "ignored-but-quantized",
                                    "is listed in quantization_config.ignore but stored quantized"))
        shape = _dense_shape(name, t, files)
        li = LayerInfo(name, gname, fmt, describe_args(w), describe_args(a), shape,
                       {k: f"{str(dt).replace('torch.', '')} {list(s)}" for k, (dt, s) in sorted(t.items())})
        layers.append(li)
        _check_layer(li, t, w, a, findings)
        if w is not None:
            add_form(forms, "experts" if _EXPERT.search(name) else "dense", w, a, fmt, name)
        if a is not None:
            act_strats[name] = a.get("strategy")
        if _HIGH_PRECISION.search(name):
            findings.append(Finding(WARN, name, "quantized-high-precision-site",
                                    "logits/embedding/norm layer is quantized; W8A8 recipes keep these in high "
                                    "precision (errors here reach every token's output)"))
    # per-tensor activation scales, and the silent kind: per-tensor where others are per-token
    per_token = [n for n, s in act_strats.items() if s in ("token", "group", "tensor_group")]
    for n, s in act_strats.items():
        if s == "tensor":
            silent = " while other layers use finer scales (a silent per-tensor fallback?)" if per_token else ""
            findings.append(Finding(WARN, n, "per-tensor-activation",
                                    "one activation scale for the whole tensor: an outlier channel costs every "
                                    f"other value its precision{silent}"))
    for gname, g in groups.items():
        if g.get("output_activations") is not None:
            findings.append(Finding(WARN, gname, "output-activations",
                                    "output activations are quantized: the error lands in the residual stream "
                                    "and accumulates across layers"))
    if qc.get("kv_cache_scheme") is not None:
        findings.append(Finding(INFO, "-", "kv-cache", f"kv cache quantized: {describe_args(qc['kv_cache_scheme'])}"))
    for loader, line in loader_warnings(forms).items():
        findings.append(Finding(WARN, "-", f"loader-{loader}", line))
    linears = _linear_names(cfg)
    _check_dense(info, qlayers, groups, ignore, linears, findings)
    _check_fused(layers, findings)
    dense = None if linears is None else sorted(set(linears) - set(qlayers), key=natural_key)
    return Report(str(d), top_fmt, layers, findings, list(ignore), dense)


def natural_key(name: str) -> list:
    """Sort key putting layers.2 before layers.10."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _span(values: list[int]) -> str:
    """{0..29} / {0..3,7}: a set of layer indices as runs."""
    vs = sorted(set(values))
    runs, start = [], vs[0]
    for a, b in zip(vs, vs[1:] + [None]):
        if b != a + 1:
            runs.append(str(start) if start == a else f"{start}..{a}")
            start = b
    return "{" + ",".join(runs) + "}"


def group_names(rows: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """(name, what) rows -> (pattern, what) rows: names that differ only in their numbers and
    share `what` become one row (model.layers.{0..29}.mlp.down_proj), in first-seen order. A
    pattern whose number sets do not cover every combination is left as separate rows."""
    groups: dict[tuple, list[str]] = {}
    for name, what in rows:
        groups.setdefault((re.sub(r"\d+", "{}", name), what), []).append(name)
    out = []
    for (template, what), names in groups.items():
        nums = [[int(v) for v in re.findall(r"\d+", n)] for n in names]
        sets = [sorted({ns[i] for ns in nums}) for i in range(len(nums[0]))]
        full = 1
        for st in sets:
            full *= len(st)
        if len(names) == 1 or full != len(names):
            out += [(n, what) for n in names]
        else:
            out.append((template.format(*[_span(st) for st in sets]), what))
    return out


def _dense_shape(name, t, files) -> list | None:
    import torch
    if "weight" in t:
        return list(t["weight"][1])
    if "weight_shape" in t:
        with TensorReader(files[f"{name}.weight_shape"]) as r:
            ws = r.get(f"{name}.weight_shape")
        if ws.dtype not in (torch.int32, torch.int64) or list(ws.shape) != [2] or int(ws.min()) < 1:
            raise CheckpointError(f"{files[f'{name}.weight_shape']}: {name}.weight_shape is {ws.dtype} "
                                  f"{list(ws.shape)}; it must hold the dense [N, K] as two positive integers")
        return [int(v) for v in ws.tolist()]
    if "weight_packed" in t and len(t["weight_packed"][1]) == 2:  # fp4: two elements per byte
        n, kp = t["weight_packed"][1]
        return [n, 2 * kp]
    return None


def _check_layer(li: LayerInfo, t: dict, w: dict | None, a: dict | None, f: list) -> None:
    name = li.name
    if w is not None and li.shape is not None and "weight_scale" in t:
        want = _expected_scale_shape(w, *li.shape)
        got = list(t["weight_scale"][1])
        if want is not None and got != want:
            kind = " (one scale for the whole weight)" if got in ([1], [1, 1]) else ""
            f.append(Finding(ERROR, name, "scale-shape",
                             f"weight_scale has shape {got}{kind} but the declared {describe_args(w)} on a "
                             f"{li.shape} weight needs {want}"))
    if w is not None:
        if not w.get("symmetric", True) and "weight_zero_point" not in t:
            f.append(Finding(ERROR, name, "missing-zero-point",
                             "weights are asymmetric but weight_zero_point is missing: a kernel would "
                             "dequantize without the zero-point term (a constant per-channel error)"))
        if w.get("symmetric", True) and "weight_zero_point" in t:
            f.append(Finding(ERROR, name, "unexpected-zero-point",
                             "weights are symmetric but a weight_zero_point is stored (vLLM refuses it)"))
    if a is not None:
        static = a.get("dynamic", False) is False
        if static and "input_scale" not in t:
            f.append(Finding(ERROR, name, "missing-input-scale", "static activation scheme but no input_scale"))
        if static and not a.get("symmetric", True) and "input_zero_point" not in t:
            f.append(Finding(ERROR, name, "missing-zero-point",
                             "activations are asymmetric but input_zero_point is missing: the kernel would "
                             "drop the z_a * sum(w) correction term"))
        if static and "input_scale" in t and a.get("strategy") == "tensor" and list(t["input_scale"][1]) not in ([1], []):
            f.append(Finding(ERROR, name, "scale-shape", f"input_scale shape {list(t['input_scale'][1])}, "
                             "per-tensor needs [1]"))
        if a.get("strategy") == "tensor_group" and a.get("dynamic") is True and "input_global_scale" not in t:
            f.append(Finding(WARN, name, "nvfp4-act-global-scale",
                             "NVFP4 activations are fully dynamic with no input_global_scale; compressed-tensors' "
                             "NVFP4 scheme (dynamic='local') has engines read a calibrated one from the checkpoint"))
        if a.get("dynamic") is True and "input_scale" in t:
            f.append(Finding(WARN, name, "stale-static-scale",
                             "dynamic activations but an input_scale is stored (a leftover calibrated scale?)"))
    elif "input_scale" in t:
        f.append(Finding(WARN, name, "orphan-input-scale", "input_scale stored but the scheme has no activations"))


def _linear_names(cfg: dict) -> set | None:
    """nn.Linear module names of the architecture in config.json (meta-device build), or
    None when transformers or the architecture is not available."""
    try:
        from lowbit.pipelines.tensorwise import linear_names_from_config
        return linear_names_from_config(cfg)
    except Exception:  # an unknown architecture only narrows the check to lm_head
        return None


def _check_dense(info, qlayers, groups, ignore, linears, f) -> None:
    import torch
    low = {torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
    targets_all = any("Linear" in g.get("targets", []) for g in groups.values())
    qset = set(qlayers)
    for n, (dt, shape, _, _) in info.items():
        mod, _, local = n.rpartition(".")
        if mod in qset:
            continue
        if dt in low:
            f.append(Finding(WARN, n, "low-precision-dense-tensor",
                             f"stored as {str(dt).replace('torch.', '')} outside any quantized layer"))
        if local != "weight" or not targets_all or any(_match(x, mod) for x in ignore):
            continue
        is_linear = mod in linears if linears is not None else mod.endswith("lm_head")
        if is_linear:
            f.append(Finding(ERROR, mod, "targeted-but-dense",
                             "config targets all Linear layers and does not ignore this one, but it is stored "
                             "unquantized; loaders will look for its weight_scale (add it to ignore)"))


def _check_fused(layers: list, f: list) -> None:
    by_block: dict[tuple, dict] = {}
    for li in layers:
        parent, _, child = li.name.rpartition(".")
        for fused, parts in _FUSED.items():
            if child in parts:
                by_block.setdefault((parent, fused), {})[child] = (li.weight, li.act)
    for (parent, fused), members in by_block.items():
        if len(set(members.values())) > 1:
            f.append(Finding(WARN, parent, "fused-mismatch",
                             f"{'/'.join(sorted(members))} have different schemes; vLLM fuses them into one "
                             f"{fused}_proj GEMM and needs one scheme"))


def format_report(r: Report) -> str:
    """The text report: one row per group of layers with the same scheme and scale shapes (the
    numbers in their names folded: model.layers.{0..29}.mlp.down_proj), the layers left in
    high precision, then the findings (--json keeps every layer)."""
    lines = [f"{r.path}: compressed-tensors, format {r.format}, {len(r.layers)} quantized layers"]
    rows = group_names([(li.name, (li.weight, li.act, ", ".join(
        f"{k}={v.split(' ', 1)[1]}" for k, v in li.tensors.items() if k.endswith(("scale", "zero_point")))))
        for li in r.layers])
    w = max([len(n) for n, _ in rows] + [5])
    cw = max([len(li.weight) for li in r.layers] + [len(li.act) for li in r.layers] + [11])
    lines.append(f"{'layer':<{w}}  {'weight':<{cw}} {'activations':<{cw}} scale shapes")
    for name, (weight, act, shapes) in rows:
        lines.append(f"{name:<{w}}  {weight:<{cw}} {act:<{cw}} {shapes}")
    kept = ", ".join(n for n, _ in group_names([(x, ()) for x in r.ignore])) or "none"
    lines.append(f"\nkept in high precision (quantization_config.ignore): {kept}")
    if r.dense_linears is not None:
        unlisted = [x for x in r.dense_linears if not any(_match(t, x) for t in r.ignore)]
        if unlisted:
            lines.append("Linears stored unquantized and not in ignore: "
                         + ", ".join(n for n, _ in group_names([(x, ()) for x in unlisted])))
    if r.findings:
        lines.append("")
        # the same finding on many layers is printed once with the layers listed (--json keeps each)
        same: dict[tuple, list] = {}
        for fd in r.findings:
            same.setdefault((fd.level, fd.code, fd.message), []).append(fd.layer)
        for (level, code, msg), names in sorted(same.items(), key=lambda kv: {ERROR: 0, WARN: 1, INFO: 2}[kv[0][0]]):
            who = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"{level.upper():7} {who}: {msg} [{code}]")
    n_err = len(r.errors)
    n_warn = sum(fd.level == WARN for fd in r.findings)
    lines.append(f"\n{n_err} error(s), {n_warn} warning(s)")
    return "\n".join(lines)


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too, not only on errors")


def run(args) -> int:
    try:
        r = inspect_checkpoint(args.dir)
    except CheckpointError as e:
        print(f"lowbit inspect: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"path": r.path, "format": r.format, "layers": [asdict(x) for x in r.layers],
                          "findings": [asdict(x) for x in r.findings]}, indent=1))
    else:
        print(format_report(r))
    bad = r.errors or (args.strict and any(fd.level == WARN for fd in r.findings))
    return 1 if bad else 0
