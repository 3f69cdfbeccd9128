"""The grouped MoE kernels compile for sm_90 (H100 / H200) without a GPU at the heuristic's default
configs (lowbit.ops.grouped_configs) for Mixtral-8x7B's decode and prefill shapes: the weight-only
kernels on the tensor cores (mma below 64 rows, wgmma from 64), no spilled registers, shared memory
within the limit. Integer arguments are marked divisible by 16 where the GPU launch specializes
them (E and the column-block count are not). Runs Triton's compiler in a subprocess (the test
process has TRITON_INTERPRET set)."""
import json

from lowbit.bench.sm90 import fresh_process

SCRIPT = r'''
import json, re
from dataclasses import replace
from lowbit.bench.sm90 import SHARED_LIMIT, compile_sm90
from lowbit.ops.grouped_configs import grouped_default_config
from lowbit.ops.triton.grouped import _grouped_w8a8_kernel
from lowbit.ops.triton.grouped_w import _grouped_w4_kernel, _grouped_w8a16_kernel
ROUTE = {"off_ptr": "*i64", "tok_ptr": "*i64"}               # Routing's int64 offsets and tokens
out = []
for M in (2, 4096):                                   # Mixtral b1 decode and 2048-token prefill rows (top-2)
    for kind, wfmt, group in (("w4a16", 0, 128), ("w4a16", 0, 32), ("w4a16", 3, 16), ("w8a16", None, None),
                              ("int8", None, None), ("fp8", None, None)):
        default = grouped_default_config(kind, 8, 4096, 14336, M)
        # the 4-bit decode tile also without the register prefetch (Triton's cp.async pipeline; a tuning candidate)
        for c in [default] + ([replace(default, prefetch=0)] if kind == "w4a16" and M == 2 and group == 128 else []):
            ints = ["E", "N", "K", "K_SPLIT", "stride_a", "stride_be", "stride_bn"]
            tiles = dict(BLOCK_M=c.block_m, E_PAD=8, BLOCK_N=c.block_n, BLOCK_K=c.block_k)
            if kind == "w4a16":
                fn = _grouped_w4_kernel
                sig = {"a_ptr": "*bf16", "b_ptr": "*u8", "c_ptr": "*bf16", "s_ptr": "*fp32" if wfmt == 0 else "*u8",
                       "z_ptr": "*i32", "g_ptr": "*fp32", "bias_ptr": "*fp32", **ROUTE}
                ints += ["stride_se", "stride_sn"]
                consts = dict(WFMT=wfmt, HAS_Z=False, HAS_G=wfmt == 3, HAS_BIAS=False, IDENTITY=M > 2, PARTIAL=False,
                              INTERP=False, GROUP=group, S=min(c.block_k, group) if wfmt == 0 else c.block_k,
                              PREFETCH=c.uses_prefetch(), **tiles)
            elif kind == "w8a16":
                fn = _grouped_w8a16_kernel
                sig = {"a_ptr": "*bf16", "b_ptr": "*i8", "c_ptr": "*bf16", "s_ptr": "*fp32", "bias_ptr": "*fp32",
                       **ROUTE}
                consts = dict(HAS_BIAS=False, IDENTITY=False, PARTIAL=False, INTERP=False, **tiles)
            else:
                fn = _grouped_w8a8_kernel
                t = "*i8" if kind == "int8" else "*fp8e4nv"
                sig = {"a_ptr": t, "b_ptr": t, "c_ptr": "*bf16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
                       "bias_ptr": "*fp32", **ROUTE}
                ints.remove("K_SPLIT")
                consts = dict(INT=kind == "int8", RAW=False, HAS_BIAS=False, IDENTITY=False, **tiles)
            ints += ["stride_c"] + ([] if kind in ("int8", "fp8") else ["stride_p"]) + ["num_n"]
            sig.update({n: "i32" for n in ints})
            r = compile_sm90(fn, sig, consts, no_div=("E", "num_n"), num_warps=c.num_warps, num_stages=c.num_stages)
            mma = len(re.findall(r"\b[HIQ]G?MMA", r["sass_text"]))
            out.append({"kind": kind, "wfmt": wfmt, "group": group, "M": M, "config": c.to_dict(),
                        "spill": r["spill_ops"], "shared": r["shared"], "limit": SHARED_LIMIT, "mma": mma})
print(json.dumps(out))
'''


def test_default_configs_compile_for_sm90_on_tensor_cores_without_spills():
    p = fresh_process(["-c", SCRIPT])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 13
    for r in rows:
        assert r["spill"] == 0 and r["shared"] <= r["limit"] and r["mma"] > 0, r


ROUTE_SCRIPT = r'''
import json
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.triton.moe_route import ROUTE_MAX_ROWS, _combine_kernel, _route_kernel
out = []
for E, k in ((8, 2), (128, 8), (256, 8)):               # Mixtral, Qwen3-30B-A3B, DeepSeek-V3
    sig = {"idx_ptr": "*i64", "token_ptr": "*i64", "slot_ptr": "*i64", "off_ptr": "*i64", "inv_ptr": "*i64",
           "R": "i32", "E": "i32"}
    r = compile_sm90(_route_kernel, sig, dict(TOP_K=k, R_PAD=ROUTE_MAX_ROWS, E_PAD=2 * E), no_div=("R", "E"),
                     num_warps=4)
    out.append({"kernel": "route", "E": E, "spill": r["spill_ops"]})
    sig = {"h_ptr": "*fp32", "w_ptr": "*fp32", "inv_ptr": "*i64", "out_ptr": "*bf16", "H": "i32",
           "stride_h": "i32", "stride_w": "i32", "stride_o": "i32"}
    r = compile_sm90(_combine_kernel, sig, dict(TOP_K=k, BLOCK=1024), no_div=("stride_w",), num_warps=4,
                     enable_fp_fusion=False)
    out.append({"kernel": "combine", "E": E, "spill": r["spill_ops"], "fma": r["sass_text"].count("FFMA")})
print(json.dumps(out))
'''


def test_route_and_combine_kernels_compile_for_sm90_without_spills_or_fused_multiply_adds():
    """The one-launch routing at its largest rows (an R x R comparison in registers) and the combine,
    whose products and sums must stay separately rounded (lowbit.ops.grouped.combine's arithmetic)."""
    p = fresh_process(["-c", ROUTE_SCRIPT])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    for r in rows:
        assert r["spill"] == 0 and r.get("fma", 0) == 0, r


DEQUANT_SCRIPT = r'''
import json, re
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.triton.dequant import _packed_dequant_kernel
sig = {"W": "*u8", "S": "*fp32", "Z": "*i32", "OUT": "*bf16", "OFF": "*i64", "R": "i32", "K": "i32", "RPE": "i32",
       "s_w": "i32", "s_s": "i32"}
out = []
for wfmt, G, zero in ((0, 128, False), (0, 32, True)):      # int4 g128, int4 g32 with zero points
    r = compile_sm90(_packed_dequant_kernel, dict(sig, S="*fp32" if wfmt == 0 else "*u8"),
                     dict(WFMT=wfmt, HAS_Z=zero, SKIP=True, G=G, BLOCK_R=16, GROUPS=256 // G), no_div=("RPE",),
                     num_warps=4)
    loads = re.findall(r"LDG\.E[.\w]*", r["sass_text"])
    out.append({"wfmt": wfmt, "G": G, "spill": r["spill_ops"], "byte_loads": sum(x.endswith(".U8") for x in loads)})
print(json.dumps(out))
'''


def test_packed_dequant_kernel_compiles_for_sm90_with_wide_loads_and_no_spills():
    """The grouped bf16 path's int4 dequantization (the W4A16 MoE prefill's cost beside the grouped GEMM) reads each
    group's packed bytes in wide loads: no one-byte load (a load per output column was the kernel's first form)."""
    p = fresh_process(["-c", DEQUANT_SCRIPT])
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for r in rows:
        assert r["spill"] == 0 and r["byte_loads"] == 0, r
