"""The file given to `lowbit check`: one reader and one error class for the linear, attention
(lowbit.entrypoints.check_attention) and grouped (lowbit.entrypoints.check_grouped) layouts.

The file is read once, by lowbit's own safetensors reader (no pickle, no memory map, every offset
checked: lowbit.io.st_format); each layout then asks for its tensors through `require` and
`require_float`, whose messages name the file, the tensor and what the layout needs.
"""
from __future__ import annotations

# the float dtypes the linear and attention checks accept (the grouped check takes any floating dtype)
FLOATS = ("float16", "bfloat16", "float32", "float64")


class BadCheckFile(ValueError):
    """A `lowbit check` input that cannot be checked (lowbit.entrypoints.main prints it, exit status 2)."""


def read(path: str) -> tuple[dict, dict]:
    """({name: tensor} for every tensor in the file, metadata str -> str) of a check file; a file that
    is not a valid safetensors file is a BadCheckFile with st_format's message (which names the file)."""
    from lowbit.io.st_format import CheckpointError, TensorReader
    try:
        with TensorReader(path) as r:
            return dict(iter(r)), r.metadata     # iter: (name, tensor) pairs; dict(r) would see keys() and index r
    except CheckpointError as e:
        raise BadCheckFile(str(e)) from e


def require(path: str, t: dict, names, layout: str) -> None:
    """BadCheckFile naming every one of `names` missing from `t`; layout: what the file needs."""
    missing = sorted(set(names) - set(t))
    if missing:
        raise BadCheckFile(f"{path}: missing tensor(s) {missing}; {layout}")


def require_float(path: str, t: dict, names, store_as: str = "a float tensor", floats=FLOATS) -> None:
    """BadCheckFile for the first of `names` present in `t` that is not stored as one of `floats`
    (dtype names; None: any floating dtype)."""
    for k in names:
        if k not in t:
            continue
        ok = t[k].is_floating_point() if floats is None else str(t[k].dtype).removeprefix("torch.") in floats
        if not ok:
            raise BadCheckFile(f"{path}: tensor {k} is {t[k].dtype}; store it as {store_as}")


def scheme(path: str, meta: dict, key: str):
    """The QuantScheme that metadata `key` declares (a QuantScheme JSON or a preset name), None for
    an absent key or "none"."""
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


def schemes(path: str, meta: dict):
    """(x_scheme, w_scheme) that the metadata declares; a file declaring neither key for a side is
    refused, since checking a quantized kernel as an unquantized one would blame the quantization on
    its arithmetic."""
    undeclared = [k for k in ("x_scheme", "w_scheme") if k not in meta]
    if undeclared:
        raise BadCheckFile(f"{path}: declare the schemes: metadata has no {' and '.join(undeclared)}; set "
                           f"{' and '.join(undeclared)} to a preset name (e.g. int8_token / int8_channel), a "
                           f"QuantScheme JSON, or \"none\" for a side the kernel does not quantize "
                           f"(safetensors: save_file(..., metadata={{'x_scheme': ..., 'w_scheme': ...}}))")
    return scheme(path, meta, "x_scheme"), scheme(path, meta, "w_scheme")


def verdict(path: str, check, *args, **kwargs) -> int:
    """check(*args, **kwargs) (check_linear, check_attention, check_grouped_linear) on a file's
    contents: prints its report and returns the exit status, 0 pass, 1 fail. A ValueError from the
    check is the file's (inputs the check refuses): a BadCheckFile naming the file."""
    try:
        v = check(*args, **kwargs)
    except ValueError as e:
        raise BadCheckFile(f"{path}: {e}") from e
    print(v.report())
    return 0 if v.passed else 1
