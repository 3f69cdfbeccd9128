"""QTensor files: safetensors tensors plus metadata that fully describes each QTensor.

    save_qtensors("w.safetensors", {"layer0.w": qt})
    qts = load_qtensors("w.safetensors", expect=lb.get_preset("mxfp8"))

Per QTensor `name` the file holds (safetensors keys):
    name.codes         int8 / uint8 codes; 4-bit codes packed two per byte and fp6 codes four
                       per three bytes (lowbit.packing) when pack=True
    name.scale         float32 (fp32 scale format only; otherwise derived from scale_codes)
    name.zero_point    int32 (asymmetric only)
    name.scale_codes   e8m0 / e4m3 codes in `scale_layout` (row_major uint8, group_major
                       uint32, blocked uint8; see lowbit.packing)
    name.global_scale  float32 0-d (two-level schemes only)
and the metadata key "lowbit.tensors" holds JSON {name: entry}; an entry records the scheme
(QuantScheme.to_dict(): format, strategy, group_size, block_structure, scale_format,
scale_rounding, ...), the shape, the codes' shape (padded K), the codes packing and the
scale layout. "lowbit.version" and "lowbit.file_version" sit beside it.

Loading validates everything before returning anything: missing, extra or inconsistent
metadata or tensors, a scheme other than the expected one (a consumer
that assumes group size 128 reading scales written per 32 computes wrong results), codes
out of range. Writing goes to a temporary file in the same directory, then an atomic rename.
Never pickles.
"""
from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

import lowbit
from lowbit.io.st_format import CheckpointError, TensorReader, loads_strict
from lowbit.packing import SCALE_LAYOUTS, pack_fp6, pack_int4, pack_scales, unpack_fp6, unpack_int4, unpack_scales
from lowbit.quantize import QTensor, scale_from_codes, scale_shape
from lowbit.scheme import QuantScheme

FILE_VERSION = "1"
_META_KEYS = {"lowbit.tensors", "lowbit.version", "lowbit.file_version"}
_ENTRY_KEYS = {"scheme", "shape", "codes_shape", "codes_packing", "scale_layout"}
_FIELDS = ("codes", "scale", "zero_point", "scale_codes", "global_scale")


class QTensorFileError(ValueError):
    """A QTensor file that cannot be loaded as asked (bad, inconsistent or unexpected content)."""


def _packing_for(scheme) -> str:
    fmt = scheme.fmt
    if fmt.bits == 4:
        return "nibble"
    if fmt.bits == 6:
        return "fp6"
    return "none"


def save_qtensors(path, tensors: Mapping[str, object], *, pack: bool = True,
                  scale_layout: str = "row_major") -> None:
    """Write {name: QTensor} to a safetensors file at `path` (atomically: temp file + rename).

    pack: store 4-bit codes two per byte and fp6 codes four per three bytes.
    scale_layout: layout of scale_codes (e8m0 / fp8 scale formats): "row_major" |
    "group_major" | "blocked" (lowbit.packing); scale_codes are viewed as 2-D
    [prod(leading dims), n_scales] for the last two."""
    from safetensors.torch import save_file

    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"save_qtensors: scale_layout must be one of {SCALE_LAYOUTS}, got {scale_layout!r}")
    if not isinstance(tensors, Mapping) or not tensors:
        raise ValueError("save_qtensors: tensors must be a non-empty dict {name: QTensor}")
    out: dict[str, torch.Tensor] = {}
    entries = {}
    for name, qt in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_qtensors: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(qt, QTensor):
            raise TypeError(f"save_qtensors: {name!r} is a {type(qt).__name__}, not a QTensor "
                            "(quantize it with lowbit.quantize first)")
        scheme = qt.scheme
        packing = _packing_for(scheme) if pack else "none"
        codes = qt.codes.detach().cpu().contiguous()
        if packing == "nibble":
            codes = pack_int4(codes, pad=True)
        elif packing == "fp6":
            codes = pack_fp6(codes, pad=True)
        out[f"{name}.codes"] = codes
        if scheme.scale_format == "fp32":
            out[f"{name}.scale"] = qt.scale.detach().cpu().to(torch.float32).contiguous()
        if qt.zero_point is not None:
            out[f"{name}.zero_point"] = qt.zero_point.detach().cpu().to(torch.int32).contiguous()
        layout = None
        if qt.scale_codes is not None:
            layout = scale_layout
            sc = qt.scale_codes.detach().cpu().contiguous()
            if layout != "row_major":
                sc = pack_scales(sc.reshape(-1, sc.shape[-1]), layout, pad=True)
            out[f"{name}.scale_codes"] = sc
        if qt.global_scale is not None:
            out[f"{name}.global_scale"] = qt.global_scale.detach().cpu().to(torch.float32).reshape(()).contiguous()
        entries[name] = {"scheme": scheme.to_dict(), "shape": list(qt.shape),
                         "codes_shape": list(qt.codes.shape), "codes_packing": packing, "scale_layout": layout}
    # safetensors refuses tensors that share memory (the same QTensor saved under two names,
    # views): give every stored tensor its own storage.
    out = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}
    meta = {"lowbit.tensors": json.dumps(entries, sort_keys=True), "lowbit.version": lowbit.__version__,
            "lowbit.file_version": FILE_VERSION}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        save_file(out, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fail(path, msg: str):
    raise QTensorFileError(f"{path}: {msg}")


def _expected_for(expect, name):
    if expect is None:
        return None
    if isinstance(expect, QuantScheme):
        return expect
    return expect.get(name)


def load_qtensors(path, expect=None, *, device: str | torch.device = "cpu") -> dict:
    """Read {name: QTensor} written by save_qtensors, validating everything first.

    expect: None; a QuantScheme every tensor must have been written with; or
    {name: QuantScheme} for some tensors (names absent from the file are an error).
    A mismatch raises QTensorFileError naming the differing fields. Nothing is returned
    unless every tensor loads."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_qtensors: no file at {path}")
    if expect is not None and not isinstance(expect, (QuantScheme, Mapping)):
        raise TypeError(f"load_qtensors: expect must be a QuantScheme or {{name: QuantScheme}}, got {type(expect).__name__}")
    try:  # lowbit's own reader: every header field and offset checked, no memory map, no pickle
        with TensorReader(path) as f:
            return _load(path, f, expect, device)
    except CheckpointError as exc:
        raise QTensorFileError(str(exc)) from exc


def _load(path, f, expect, device) -> dict:
    meta = f.metadata
    if "lowbit.tensors" not in meta:
        _fail(path, "not a lowbit QTensor file: no 'lowbit.tensors' metadata (model checkpoints are read by "
                    "lowbit.pipelines.checkpoint)")
    missing, extra = _META_KEYS - set(meta), set(meta) - _META_KEYS
    if missing or extra:
        _fail(path, f"metadata keys: missing {sorted(missing)}, unexpected {sorted(extra)}")
    if meta["lowbit.file_version"] != FILE_VERSION:
        _fail(path, f"file version {meta['lowbit.file_version']!r}; this lowbit reads version {FILE_VERSION}")
    try:
        entries = loads_strict(meta["lowbit.tensors"])
    except (ValueError, RecursionError) as exc:
        _fail(path, f"'lowbit.tensors' metadata is not valid JSON ({exc})")
    if not isinstance(entries, dict) or not entries:
        _fail(path, "'lowbit.tensors' metadata must be a non-empty JSON object {name: entry}")
    if isinstance(expect, Mapping):
        absent = sorted(set(expect) - set(entries))
        if absent:
            _fail(path, f"expected tensors {absent} are not in the file (it holds {sorted(entries)})")

    keys = set(f.keys())
    wanted: set[str] = set()
    plans = {}
    for name, entry in entries.items():
        plans[name] = _plan(path, name, entry, expect)
        wanted |= {f"{name}.{fld}" for fld in plans[name]["fields"]}
    if keys != wanted:
        _fail(path, f"tensors do not match the metadata: missing {sorted(wanted - keys)}, "
                    f"unexpected {sorted(keys - wanted)}")
    result = {name: _build(path, name, plan, {fld: f.get(f"{name}.{fld}") for fld in plan["fields"]})
              for name, plan in plans.items()}
    if torch.device(device).type != "cpu":
        result = {n: qt.to(device) for n, qt in result.items()}
    return result


def _plan(path, name, entry, expect) -> dict:
    """Check one metadata entry; return what its tensors must look like."""
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        _fail(path, f"tensor {name!r}: metadata entry must have keys {sorted(_ENTRY_KEYS)}, got {got}")
    try:
        scheme = QuantScheme.from_dict(entry["scheme"])
    except (ValueError, TypeError) as exc:
        _fail(path, f"tensor {name!r}: bad scheme metadata ({exc})")
    want = _expected_for(expect, name)
    if want is not None and want != scheme:
        diffs = [f"{k}={scheme.to_dict()[k]!r} (expected {v!r})" for k, v in want.to_dict().items()
                 if scheme.to_dict()[k] != v]
        _fail(path, f"tensor {name!r} was written as {scheme} but {want} was expected: " + ", ".join(diffs)
              + ". Reading it with the wrong granularity or rule computes wrong results; "
                "re-quantize, or load with the scheme it was written with.")
    shape, cshape = entry["shape"], entry["codes_shape"]
    for what, s in (("shape", shape), ("codes_shape", cshape)):
        if not (isinstance(s, list) and s and all(isinstance(v, int) and v > 0 for v in s)):
            _fail(path, f"tensor {name!r}: {what} must be a non-empty list of positive ints, got {s!r}")
    width = {"group": scheme.group_size, "block": (scheme.block_size or (1, 1))[1]}.get(scheme.strategy, 1)
    padded_k = -(-shape[-1] // width) * width
    if cshape[:-1] != shape[:-1] or cshape[-1] != padded_k:
        _fail(path, f"tensor {name!r}: codes_shape {cshape} is inconsistent with shape {shape} under {scheme} "
                    f"(expected {shape[:-1] + [padded_k]})")
    packing, layout = entry["codes_packing"], entry["scale_layout"]
    if packing not in ("none", _packing_for(scheme)):
        _fail(path, f"tensor {name!r}: codes_packing {packing!r} does not fit format {scheme.format}")
    if (layout is None) != (scheme.scale_format == "fp32") or (layout is not None and layout not in SCALE_LAYOUTS):
        _fail(path, f"tensor {name!r}: scale_layout {layout!r} does not fit scale_format {scheme.scale_format!r}")
    fields = ["codes"]
    fields += ["scale"] if scheme.scale_format == "fp32" else ["scale_codes"]
    fields += [] if scheme.symmetric else ["zero_point"]
    fields += ["global_scale"] if scheme.two_level else []
    return {"scheme": scheme, "shape": tuple(shape), "codes_shape": tuple(cshape), "packing": packing,
            "layout": layout, "scale_shape": scale_shape(tuple(cshape), scheme), "fields": fields}


def _build(path, name, plan, t: dict):
    """Unpack and check one QTensor's tensors against its plan."""
    scheme, cshape, sshape = plan["scheme"], plan["codes_shape"], plan["scale_shape"]
    fmt = scheme.fmt

    def check(fld, tensor, dtype, shape):
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            _fail(path, f"tensor {name!r}: {fld} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} "
                        f"{tuple(shape)} for {scheme} of shape {list(plan['shape'])}")

    codes = t["codes"]
    code_dtype = torch.int8 if fmt.kind == "int" and fmt.signed else torch.uint8
    k = cshape[-1]
    try:
        if plan["packing"] == "nibble":
            check("codes", codes, torch.uint8, cshape[:-1] + (-(-k // 2),))
            codes = unpack_int4(codes, signed=fmt.kind == "int" and fmt.signed, k=k)
        elif plan["packing"] == "fp6":
            check("codes", codes, torch.uint8, cshape[:-1] + (3 * (-(-k // 4)),))
            codes = unpack_fp6(codes, k=k)
    except ValueError as exc:
        _fail(path, f"tensor {name!r}: cannot unpack codes ({exc})")
    check("codes", codes, code_dtype, cshape)
    if fmt.kind == "int":
        lo, hi = (-fmt.qmax, fmt.qmax) if scheme.symmetric else (fmt.qmin, fmt.qmax)
        if int(codes.min()) < lo or int(codes.max()) > hi:
            _fail(path, f"tensor {name!r}: codes span [{int(codes.min())}, {int(codes.max())}], outside "
                        f"[{lo}, {hi}] of {scheme}; the file is corrupt")
    elif int(codes.max()) >= 1 << fmt.bits:
        _fail(path, f"tensor {name!r}: codes exceed {fmt.bits}-bit patterns; the file is corrupt")
    zp = t.get("zero_point")
    if zp is not None:
        check("zero_point", zp, torch.int32, sshape)
    scale_codes = global_scale = None
    if scheme.scale_format == "fp32":
        scale = t["scale"]
        check("scale", scale, torch.float32, sshape)
    else:
        sc = t["scale_codes"]
        rows, n = math.prod(sshape[:-1]), sshape[-1]
        try:
            scale_codes = unpack_scales(sc, plan["layout"], rows, n).reshape(sshape) if plan["layout"] != "row_major" else sc
        except ValueError as exc:
            _fail(path, f"tensor {name!r}: scale_codes do not fit layout {plan['layout']!r} ({exc})")
        check("scale_codes", scale_codes, torch.uint8, sshape)
        if scheme.two_level:
            global_scale = t["global_scale"]
            check("global_scale", global_scale, torch.float32, ())
        scale = scale_from_codes(scale_codes, scheme, global_scale)
    return QTensor(codes, scale, zp, scheme, plan["shape"], scale_codes, global_scale)
