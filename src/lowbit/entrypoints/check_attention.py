"""`lowbit check attn.safetensors` for attention kernels (metadata kind = "attention").

Tensors: out [B, Hq, Tq, D] and q [B, Hq, Tq, D] (the ORIGINAL queries, float); the cache either
as stored, k_codes / v_codes [B, Hkv, Tk, D] (uint8 fp8 bit patterns or int8; int4 either int8
one code per byte or uint8 [B, Hkv, Tk, D / 2] two per byte, low nibble first) with k_scale /
v_scale (float32, shaped as lowbit.ops.kv_quant says for kv_scheme), or unquantized k / v (float).
Metadata (strings): kind=attention, kv_scheme (e.g. "fp8-head", "int8-token", "int4-g32"; needed
with codes), q_format / p_format ("fp8_e4m3fn" | "int8" | "none"), p_block (keys per P scale),
causal ("true" | "false"), sm_scale (absent = 1/sqrt(D)). Exit 0 pass, 1 fail, 2 bad file.
"""
from __future__ import annotations

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class BadCheckFile(ValueError):
    """An attention check file that cannot be checked (lowbit.entrypoints.main prints it, exit status 2)."""


def _fmt(path, meta, key, default):
    v = meta.get(key, default)
    return None if v in (None, "", "none", "null") else v


def read_attention_file(path: str):
    """(out, q, k, v, AttnSpec) with k / v as KVQuant or float tensors; every field validated."""
    from lowbit.io.st_format import CheckpointError, TensorReader
    from lowbit.ops import attention_reference as ar
    from lowbit.ops.kv_quant import KVQuant, KVScheme
    try:
        with TensorReader(path) as r:
            meta, names = r.metadata, set(r.keys())
            t = {k: r.get(k) for k in names}
    except CheckpointError as e:
        raise BadCheckFile(str(e)) from e
    for need in ("out", "q"):
        if need not in t:
            raise BadCheckFile(f"{path}: missing tensor {need!r}; an attention check file needs out and q "
                               "[B, Hq, Tq, D] and the cache (k_codes / k_scale / v_codes / v_scale, or k / v)")
    for k in ("out", "q", "k", "v"):
        if k in t and str(t[k].dtype).removeprefix("torch.") not in _FLOATS:
            raise BadCheckFile(f"{path}: tensor {k} is {t[k].dtype}; store it as a float tensor")
    try:
        spec = ar.AttnSpec(q_format=_fmt(path, meta, "q_format", "fp8_e4m3fn"),
                           p_format=_fmt(path, meta, "p_format", "fp8_e4m3fn"),
                           p_block=int(meta.get("p_block", "64")),
                           causal={"true": True, "false": False}[meta.get("causal", "true").lower()],
                           sm_scale=float(meta["sm_scale"]) if "sm_scale" in meta else None)
    except (ValueError, KeyError) as e:
        raise BadCheckFile(f"{path}: attention metadata is invalid ({e}); see `lowbit check --help`") from e
    sides = []
    for side in ("k", "v"):
        if f"{side}_codes" in t:
            if "kv_scheme" not in meta:
                raise BadCheckFile(f"{path}: {side}_codes given but no kv_scheme in the metadata (e.g. 'fp8-head')")
            if f"{side}_scale" not in t:
                raise BadCheckFile(f"{path}: {side}_codes given without {side}_scale")
            try:
                sides.append(KVQuant(t[f"{side}_codes"], t[f"{side}_scale"], KVScheme.parse(meta["kv_scheme"])))
            except ValueError as e:
                raise BadCheckFile(f"{path}: {side}: {e}") from e
        elif side in t:
            sides.append(t[side])
        else:
            raise BadCheckFile(f"{path}: no {side}_codes / {side}_scale and no {side}: the cache is missing")
    return t["out"], t["q"], sides[0], sides[1], spec


def run(path: str) -> int:
    from lowbit.verify.attention import check_attention
    out, q, k, v, spec = read_attention_file(path)
    try:
        verdict = check_attention(out, q, k, v, spec)
    except ValueError as e:
        raise BadCheckFile(f"{path}: {e}") from e
    print(verdict.report())
    return 0 if verdict.passed else 1
