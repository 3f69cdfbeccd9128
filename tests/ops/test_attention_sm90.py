"""The attention kernel compiles for sm_90 (H100 / H200) without a GPU: every mode the dispatch can
pick, decode's specialized constants (Tq = Tk = G = 1), and prefill at head_dim 128 with the launch-
time specializations the GPU gives (unit strides as constants, other ints marked divisible by 16
only where they are), within the shared memory the launcher's smem_bytes estimate promises at the
pipelining depth it picks, at the tiles and warps pick_tiles chooses; the tensor-core mode without
spilling registers (no local loads / stores in the SASS). Runs Triton's compiler in a subprocess
(the test process has TRITON_INTERPRET set)."""
import json

from lowbit.bench.sm90 import fresh_process
from lowbit.ops.triton.attention_decode import launch_warps

SCRIPT = r'''
import json
import triton.language as tl
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.triton.attention import _flash_kernel, pick_stages, pick_tiles, smem_bytes
INTS = ["Tq", "Tk", "D", "G", "sq_b", "sq_h", "sq_t", "sq_d", "sqs_b", "sqs_h", "sqs_t", "sk_b", "sk_h", "sk_t",
        "sk_d", "sks_b", "sks_h", "sks_t", "sks_g", "K_GS", "sv_b", "sv_h", "sv_t", "sv_d", "svs_b", "svs_h",
        "svs_t", "svs_g", "V_GS", "so_b", "so_h", "so_t", "so_d", "Hkv"]
CONST = ["K_KIND", "V_KIND", "K_GROUPED", "V_GROUPED", "P_MODE", "FMAX", "CAUSAL", "MMA", "DOT_TY", "DOT_PREC",
         "FAST_FP8", "BLOCK_M", "BLOCK_N", "BLOCK_D", "OUT_TY"]
# B=1, Hq=8, Hkv=2, Tq=Tk=300, D=128 (q fp32, out fp32): one scale per token, or int4 per group of 8
PREFILL = dict(Tq=300, Tk=300, D=128, G=4, sq_b=307200, sq_h=38400, sq_t=128, sq_d=1, sqs_b=0, sqs_h=0, sqs_t=0,
               sk_b=76800, sk_h=38400, sk_t=128, sk_d=1, sv_b=76800, sv_h=38400, sv_t=128, sv_d=1,
               so_b=307200, so_h=38400, so_t=128, so_d=1, Hkv=2)
TOKEN = dict(sks_b=600, sks_h=300, sks_t=1, sks_g=1, K_GS=128, svs_b=600, svs_h=300, svs_t=1, svs_g=1, V_GS=128)
GROUP8 = dict(sks_b=9600, sks_h=4800, sks_t=16, sks_g=1, K_GS=8, svs_b=9600, svs_h=4800, svs_t=16, svs_g=1, V_GS=8)
out = []
for kdt, kind, grouped, mma, pm, rows, ones, spec_ints, ot in [
        ("*u8", 0, False, True, 0, 1200, False, None, "*bf16"), ("*i8", 1, True, False, 1, 1200, False, None, "*bf16"),
        ("*u8", 0, False, True, 0, 1, True, None, "*bf16"), ("*u8", 0, False, False, 0, 1200, False, TOKEN, "*fp32"),
        ("*i8", 1, True, False, 0, 1200, False, GROUP8, "*fp32")]:
    bm, warps = pick_tiles(rows, mma)
    sig = {"q_ptr": "*fp32", "qs_ptr": "*fp32", "k_ptr": kdt, "ks_ptr": "*fp32", "v_ptr": kdt, "vs_ptr": "*fp32",
           "o_ptr": ot, "c": "fp32", **{n: "i32" for n in INTS}, **{n: "constexpr" for n in CONST}}
    consts = dict(K_KIND=kind, V_KIND=kind, K_GROUPED=grouped, V_GROUPED=grouped, P_MODE=pm, FMAX=448.0,
                  CAUSAL=True, MMA=mma, DOT_TY=tl.float16, DOT_PREC="tf32", FAST_FP8=True, BLOCK_M=bm, BLOCK_N=64, BLOCK_D=128,
                  OUT_TY=tl.float32 if ot == "*fp32" else tl.bfloat16)
    no_div = ()
    if ones:
        for n in ("Tq", "Tk", "G"):
            sig[n] = "constexpr"
            consts[n] = 1
    if spec_ints:
        vals = {**PREFILL, **spec_ints}
        for n, v in vals.items():
            if v == 1:
                sig[n] = "constexpr"
                consts[n] = 1
        no_div = tuple(n for n, v in vals.items() if v != 1 and v % 16)
    tile = dict(bm=bm, bn=64, bd=128, mma=mma, k_bytes=1, v_bytes=1, k_grouped=grouped, v_grouped=grouped)
    stages = pick_stages(**tile)
    r = compile_sm90(_flash_kernel, sig, consts, no_div=no_div, num_warps=warps, num_stages=stages)
    r = {k: v for k, v in r.items() if k != "sass_text"}     # spill_ops: local loads / stores in the SASS
    out.append({**r, "mma": mma, "stages": stages, "estimate": smem_bytes(stages=stages, **tile)})
print(json.dumps(out))
'''


def test_attention_kernel_compiles_for_sm90():
    res = fresh_process(["-c", SCRIPT], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 5
    for r in rows:
        assert r["shared"] <= r["estimate"], r     # the launcher's estimate bounds what Triton allocates
        assert r["shared"] <= 232448, r            # fits one sm_90 block
    assert rows[3]["stages"] == 3                  # per-token scales: a vector per key block, full pipelining
    # the tensor-core mode keeps everything in registers at the launcher's tiles; the fp32-dot mode's
    # FMA dot (each thread holds its operand rows across the whole head dim) still spills some
    # (docs/kv-cache.md, speed): no bound asserted for it beyond compiling and fitting
    for r in rows:
        if r["mma"]:
            assert r["local"] == 0 and r["spill_ops"] == 0, r


SPLIT_SCRIPT = r'''
import json
import triton.language as tl
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.triton.attention_decode import STAGES, _merge_kernel, _split_kernel, launch_warps
INTS = ["Tq", "Tk", "D", "G", "SPLIT", "NSPLIT", "sq_b", "sq_h", "sq_t", "sq_d", "sqs_b", "sqs_h", "sqs_t",
        "sk_b", "sk_h", "sk_t", "sk_d", "sks_b", "sks_h", "sks_t", "sv_b", "sv_h", "sv_t", "sv_d", "svs_b", "svs_h",
        "svs_t", "so_b", "so_h", "so_t", "so_d", "Hq", "Hkv"]
CONST = ["Q_FMT", "QMAX", "K_KIND", "V_KIND", "K_TOKEN", "V_TOKEN", "P_MODE", "FMAX", "CAUSAL", "PV_SPLIT", "FINAL",
         "FAST_FP8", "SPLIT3", "QK_TY", "PV_TY", "DOT_PREC", "BLOCK_M", "BLOCK_N", "BLOCK_D", "EVEN_D", "OUT_TY"]
T = 32768   # a Llama-3-8B decode step: B=16, Hq=32, Hkv=8, Tq=1, D=128, bf16 q and output, 4 splits; one
# query per row sees every key, so the launcher passes CAUSAL=False at Tq = 1
BASE = dict(Tq=1, Tk=T, D=128, G=4, SPLIT=T // 4, NSPLIT=4, sq_b=4096, sq_h=128, sq_t=128, sq_d=1, sqs_b=0,
            sqs_h=0, sqs_t=0, sk_b=8 * T * 128, sk_h=T * 128, sk_t=128, sk_d=1, sks_b=0, sks_h=1, sks_t=0,
            sv_b=8 * T * 128, sv_h=T * 128, sv_t=128, sv_d=1, svs_b=0, svs_h=1, svs_t=0,
            so_b=4096, so_h=128, so_t=128, so_d=1, Hq=32, Hkv=8)
TOKEN = dict(sks_b=8 * T, sks_h=T, sks_t=1, svs_b=8 * T, svs_h=T, svs_t=1)
out = []
# (name, K/V code type, kind, per-token scales, Q format (2: bf16 Q), P mode)
# (the 2-warp launch, which B * Hkv >= 64 gets, checked in the first mode; 4 warps in every mode)
for name, kdt, kind, token, qf, pm, warps in [("fp8 head, Q fp8, P fp8", "*u8", 0, False, 1, 0, 4),
                                              ("fp8 head, Q fp8, P fp8, 2 warps", "*u8", 0, False, 1, 0, 2),
                                              ("int8 head, Q int8, P int8", "*i8", 1, False, 0, 1, 4),
                                              ("fp8 token, Q fp8, P fp8", "*u8", 0, True, 1, 0, 4),
                                              ("fp8 head, bf16 Q, P fp32", "*u8", 0, False, 2, 2, 4)]:
    vals = {**BASE, **(TOKEN if token else {})}
    pv_split = token or pm == 2
    sig = {"q_ptr": "*bf16", "qs_ptr": "*fp32", "k_ptr": kdt, "ks_ptr": "*fp32", "v_ptr": kdt, "vs_ptr": "*fp32",
           "o_ptr": "*bf16", "op_ptr": "*fp32", "mp_ptr": "*fp32", "lp_ptr": "*fp32", "c": "fp32",
           **{n: "i32" for n in INTS}, **{n: "constexpr" for n in CONST}}
    consts = dict(Q_FMT=qf, QMAX={0: 127.0, 1: 448.0, 2: 0.0}[qf], K_KIND=kind, V_KIND=kind, K_TOKEN=token,
                  V_TOKEN=token, P_MODE=pm, FMAX={0: 448.0, 1: 127.0, 2: 1.0}[pm], CAUSAL=False, PV_SPLIT=pv_split,
                  FINAL=False, FAST_FP8=True, SPLIT3=True, QK_TY=tl.bfloat16 if qf == 2 else tl.float16,
                  PV_TY=tl.bfloat16 if pv_split else tl.float16, DOT_PREC="tf32", BLOCK_M=16, BLOCK_N=64,
                  BLOCK_D=128, EVEN_D=True, OUT_TY=tl.bfloat16)
    for n, v in vals.items():
        if v == 1:
            sig[n] = "constexpr"
            consts[n] = 1
    no_div = tuple(n for n, v in vals.items() if v != 1 and v % 16)
    r = compile_sm90(_split_kernel, sig, consts, no_div=no_div, num_warps=warps, num_stages=STAGES)
    out.append({**{k: v for k, v in r.items() if k != "sass_text"}, "name": name})
msig = {"op_ptr": "*fp32", "mp_ptr": "*fp32", "lp_ptr": "*fp32", "o_ptr": "*bf16", "Hq": "i32", "Tq": "constexpr",
        "D": "i32", "NSPLIT": "i32", "so_b": "i32", "so_h": "i32", "so_t": "i32", "so_d": "constexpr",
        "BLOCK_S": "constexpr", "BLOCK_D": "constexpr", "OUT_TY": "constexpr"}
r = compile_sm90(_merge_kernel, msig, dict(Tq=1, so_d=1, BLOCK_S=64, BLOCK_D=128, OUT_TY=tl.bfloat16), num_warps=4)
out.append({**{k: v for k, v in r.items() if k != "sass_text"}, "name": "merge"})
print(json.dumps(out))
'''


def test_split_kv_kernel_compiles_for_sm90_without_spills():
    """The decode kernel at a Llama-3-8B decode step's shapes and launch options, in each mode the
    dispatch can give it, and the merge kernel: compiled for sm_90, within one block's shared
    memory, no local loads / stores (register spills) in the SASS."""
    res = fresh_process(["-c", SPLIT_SCRIPT], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    assert launch_warps(16, 8) == 4 and launch_warps(16, 128) == 2 and launch_warps(32, 128) == 8
    for r in rows:
        assert r["shared"] <= 232448, r
        assert r["local"] == 0 and r["spill_ops"] == 0, r


PREFILL_SCRIPT = r'''
import json, re
import triton.language as tl
from lowbit.bench.sm90 import compile_sm90
from lowbit.ops.triton.attention import smem_bytes
from lowbit.ops.triton.attention_prefill import _prefill_kernel, default_config
INTS = ["Tq", "Tk", "D", "G", "NM", "sq_b", "sq_h", "sq_t", "sq_d", "sqs_b", "sqs_h", "sqs_t", "sk_b", "sk_h", "sk_t",
        "sk_d", "sks_b", "sks_h", "sks_t", "sv_b", "sv_h", "sv_t", "sv_d", "svs_b", "svs_h", "so_b", "so_h", "so_t",
        "so_d", "Hq"]
CONST = ["K_KIND", "V_KIND", "K_TOKEN", "P_MODE", "FMAX", "CAUSAL", "FAST_FP8", "DOT_TY", "DOT_PREC", "EVEN_D",
         "BLOCK_M", "BLOCK_N", "BLOCK_D", "OUT_TY"]
T = 2048    # Llama-3-8B prefill: B=1, Hq=32, Hkv=8, D=128, fp32 Q codes, bf16 output; fp8 K per tensor or token
BASE = dict(Tq=T, Tk=T, D=128, G=4, NM=16, sq_b=32*T*128, sq_h=T*128, sq_t=128, sq_d=1, sqs_b=32*T, sqs_h=T, sqs_t=1,
            sk_b=8*T*128, sk_h=T*128, sk_t=128, sk_d=1, sks_b=0, sks_h=0, sks_t=0, sv_b=8*T*128, sv_h=T*128,
            sv_t=128, sv_d=1, svs_b=0, svs_h=0, so_b=32*T*128, so_h=T*128, so_t=128, so_d=1, Hq=32)
out = []
cfg = default_config(128, T, 64)
for token in (False, True):
    vals = {**BASE, **(dict(sks_b=8*T, sks_h=T, sks_t=1) if token else {})}
    sig = {"q_ptr": "*fp32", "qs_ptr": "*fp32", "k_ptr": "*u8", "ks_ptr": "*fp32", "v_ptr": "*u8", "vs_ptr": "*fp32",
           "o_ptr": "*bf16", "c": "fp32", **{n: "i32" for n in INTS}, **{n: "constexpr" for n in CONST}}
    consts = dict(K_KIND=0, V_KIND=0, K_TOKEN=token, P_MODE=0, FMAX=448.0, CAUSAL=True, FAST_FP8=True,
                  DOT_TY=tl.float16, DOT_PREC="tf32", EVEN_D=True, BLOCK_M=cfg.block_m, BLOCK_N=64, BLOCK_D=128,
                  OUT_TY=tl.bfloat16)
    for n, v in vals.items():
        if v in (0, 1):
            sig[n] = "constexpr"
            consts[n] = v
    r = compile_sm90(_prefill_kernel, sig, consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    s = r.pop("sass_text")
    out.append({**r, "token": token, "wgmma": len(re.findall(r"HGMMA", s)),
                "estimate": smem_bytes(cfg.block_m, 64, 128, True, 1, 1, False, False, cfg.num_stages)})
print(json.dumps(out))
'''


def test_prefill_kernel_compiles_for_sm90_on_tensor_cores_without_spills():
    """The tensor-core prefill kernel at its default configuration and a Llama-3-8B prefill's shapes:
    wgmma (HGMMA) for both dots in both key loops, within the smem estimate, no register spills."""
    res = fresh_process(["-c", PREFILL_SCRIPT], timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for r in rows:
        assert r["wgmma"] >= 4, r
        assert r["shared"] <= r["estimate"] and r["shared"] <= 232448, r
        assert r["local"] == 0 and r["spill_ops"] == 0, r
