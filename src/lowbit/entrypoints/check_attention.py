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

from lowbit.entrypoints import check_file
from lowbit.entrypoints.check_file import BadCheckFile


def _fmt(path, meta, key, default):
    v = meta.get(key, default)
    return None if v in (None, "", "none", "null") else v


def attention_inputs(path: str, t: dict, meta: dict):
    """(out, q, k, v, AttnSpec) of an attention check file's tensors and metadata
    (lowbit.entrypoints.check_file.read), k / v as KVQuant or float tensors; every field validated."""
    from lowbit.ops import attention_reference as ar
    from lowbit.ops.kv_quant import KVQuant, KVScheme
    check_file.require(path, t, ("out", "q"), "an attention check file needs out and q [B, Hq, Tq, D] and the "
                                             "cache (k_codes / k_scale / v_codes / v_scale, or k / v)")
    check_file.require_float(path, t, ("out", "q", "k", "v"))
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


def run(path: str, t: dict, meta: dict) -> int:
    """Check an attention file's contents (as lowbit.entrypoints.check_file.read returns them)."""
    from lowbit.verify.attention import check_attention
    return check_file.verdict(path, check_attention, *attention_inputs(path, t, meta))
