"""The large-M GEMM kernels compiled for sm_90 without a GPU (`python -m lowbit.bench.gemm_sass`):
one JSON line per kernel and launch config -- the configs pick_config chooses from 2048 rows on
and the warp-specialized ones the benchmark times next to them (lowbit.ops.triton.common.WS_CONFIGS) --
with static SASS size, shared memory, registers, warps after specialization and whether the K
loop really was split into producer and consumer warpgroups. Triton accepts
`warp_specialize=True` on loops it then compiles as plain loops (a flattened persistent loop,
num_warps other than 4): the CI test reads `warp_specialized` so a config that silently lost
its specialization fails there, not on the next GPU run."""
from __future__ import annotations

import json


def _desc(dtype: str, rows: int, cols: int) -> str:
    return f"tensordesc<{dtype}[{rows}, {cols}]>"


def _kernel_and_signature(kind: str, cfg: dict):
    """(jit function, signature, constexprs) of the lowbit GEMM `kind` ("int8", "fp8",
    "block") under launch config `cfg` with TMA descriptors, as its host launcher passes them."""
    from lowbit.ops.triton import gemm_blockscaled, gemm_fp8, gemm_int8

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ints = ("M", "N", "K", "stride_am", "stride_bn", "stride_cm")
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8), USE_TMA=True,
                 PERSISTENT=bool(cfg.get("PERSISTENT")), NUM_SMS=132, WS=bool(cfg.get("WS")))
    if kind == "int8":
        sig = dict(a_ptr=_desc("i8", bm, bk), b_ptr=_desc("i8", bn, bk), c_ptr="*bf16", sa_ptr="*fp32",
                   sb_ptr="*fp32", za_ptr="*i32", colsum_ptr="*i32", bias_ptr="*bf16",
                   **{n: "i32" for n in ints + ("stride_sa", "stride_sb", "stride_za")})
        return gemm_int8._int8_gemm_kernel, sig, dict(HAS_SCALES=True, HAS_ZP=False, HAS_BIAS=False, EVEN_K=True,
                                                      **tiles)
    if kind == "fp8":
        sig = dict(a_ptr=_desc("fp8e4nv", bm, bk), b_ptr=_desc("fp8e4nv", bn, bk), c_ptr="*bf16", sa_ptr="*fp32",
                   sb_ptr="*fp32", bias_ptr="*bf16", **{n: "i32" for n in ints + ("stride_sa", "stride_sb")})
        return gemm_fp8._fp8_gemm_kernel, sig, dict(HAS_BIAS=False, PRECISE=cfg.get("PRECISE", True), EVEN_K=True,
                                                    PROMOTE_K=min(bk, 128), **tiles)
    sig = dict(a_ptr=_desc("fp8e4nv", bm, 128), b_ptr=_desc("fp8e4nv", bn, 128), c_ptr="*bf16", sa_ptr="*fp32",
               sb_ptr="*fp32", bias_ptr="*bf16", **{n: "i32" for n in ints + ("stride_sam", "stride_sbn")})
    return gemm_blockscaled._blockscaled_kernel, sig, dict(G=128, R=128, E8M0=False, HAS_BIAS=False, **tiles)


def sass_rows() -> list[dict]:
    from lowbit.bench.sm90 import SHARED_LIMIT, compile_sm90
    from lowbit.ops.triton.common import WS_CONFIGS, interpreting, pick_config

    if interpreting():
        raise RuntimeError("compile for sm_90 in a process without TRITON_INTERPRET (pick_config "
                           "answers with the interpreter's small tiles there)")
    # pick_config's choices at 8192^3, then the warp-specialized configs, also persistent
    variants = [(k, pick_config(8192, 8192, 8192, block_k_multiple=bk, kind=kind))
                for k, kind, bk in (("int8", "int8", 1), ("fp8", "fp8", 1), ("block", "block128", 128))]
    variants += [(k, WS_CONFIGS[k]) for k in ("int8", "fp8", "block")]
    variants += [("fp8", dict(WS_CONFIGS["fp8"], PRECISE=False)), ("fp8", dict(WS_CONFIGS["fp8"], PERSISTENT=True))]
    rows = []
    for kind, cfg in variants:
        fn, sig, consts = _kernel_and_signature(kind, cfg)
        row = dict(kernel=kind, config={k: v for k, v in cfg.items()})
        try:
            c = compile_sm90(fn, sig, consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        except Exception as exc:  # noqa: BLE001 -- reported; the CI test fails on it
            rows.append(dict(row, sass_static=None, error=f"{type(exc).__name__}: {str(exc)[-300:]}"))
            continue
        rows.append(dict(row, sass_static=c["sass"], shared=c["shared"], fits=c["shared"] <= SHARED_LIMIT,
                         reg=c["reg"], warps=c["warps"], warp_specialized=c["warp_specialized"],
                         setmaxnreg=c["sass_text"].count("USETMAXREG")))
    return rows


if __name__ == "__main__":
    for r in sass_rows():
        print(json.dumps(r))
