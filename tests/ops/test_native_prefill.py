"""The native prefill GEMMs (csrc/prefill_kernels.cu, CUTLASS; lowbit.ops.native.prefill).

Here, without a GPU: every argument check runs before the library is loaded (each refusal names the argument
and the fix); the M-major copy of the activation scales is exact; the library compiles for sm_90a with the pip
CUDA toolchain and CUTLASS's headers, loads (the CUDA runtime is linked statically), and its C side refuses
bad shapes and configs with the documented codes before it touches a GPU. The compile is of every
configuration (the library that ships; about two minutes on 2 CPU cores; a register spill fails it) and is
cached by source hash. On an sm_90 GPU: every configuration against lowbit's float64 reference (check_quantized, with
the fp8 tensor core's accumulator model) and against lowbit's Triton fp8 GEMMs, at shapes that are not tile
multiples."""
import ctypes
import os
import re

import pytest
import torch

import lowbit as lb
from lowbit.ops.kernels.base import fp8_dot_accumulator
from lowbit.ops.native import build, library
from lowbit.ops.native import prefill as pf
from lowbit.ops.reference import qlinear_reference
from lowbit.ops.triton.gemm_blockscaled import fp8_block_gemm
from lowbit.ops.triton.gemm_fp8 import fp8_gemm
from lowbit.recipes.presets import get_recipe
from lowbit.verify.check import check_quantized
from lowbit.verify.tolerance import implementation_gate

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
E4M3 = torch.float8_e4m3fn


def _rowwise_args(M=33, N=48, K=64, device="cpu"):
    a = torch.zeros(M, K, dtype=E4M3, device=device)
    b = torch.zeros(N, K, dtype=E4M3, device=device)
    return dict(a=a, b=b, sa=torch.ones(M, device=device), sb=torch.ones(N, 1, device=device))


def _blockwise_args(M=33, N=144, K=256, device="cpu"):
    a = torch.zeros(M, K, dtype=torch.uint8, device=device)
    b = torch.zeros(N, K, dtype=torch.uint8, device=device)
    return dict(a=a, b=b, sa=torch.ones(M, K // 128, device=device), sb=torch.ones(-(-N // 128), K // 128, device=device))


@pytest.fixture
def no_load(monkeypatch):
    """The checks must run before the library is loaded: loading fails the test."""
    def boom():
        raise AssertionError("the library was loaded before the arguments were checked")
    monkeypatch.setattr(pf, "load_prefill", boom)


ROWWISE_BAD = [  # (what to change, the words the error must hold)
    (dict(a=torch.zeros(33, 64, dtype=torch.bfloat16)), ["a", "float8_e4m3fn"]),
    (dict(a=torch.zeros(64, 33, dtype=E4M3).t()), ["a", "contiguous", "a.contiguous()"]),
    (dict(b=torch.zeros(48, 80, dtype=E4M3)), ["K must match"]),
    (dict(a=torch.zeros(33, 72, dtype=E4M3), b=torch.zeros(48, 72, dtype=E4M3)), ["K = 72", "multiple of 16", "80"]),
    (dict(b=torch.zeros(40, 64, dtype=E4M3), sb=torch.ones(40)), ["N = 40", "multiple of 16", "48"]),
    (dict(a=torch.zeros(0, 64, dtype=E4M3), sa=torch.ones(0)), ["positive", "M = 0"]),
    (dict(sa=torch.ones(33, dtype=torch.float16)), ["sa", "float32", "sa.float()"]),
    (dict(sa=torch.ones(1)), ["sa", "[M]", "(33,)"]),
    (dict(sb=torch.ones(48, 2)[:, 0]), ["sb", "contiguous"]),
    (dict(bias=torch.ones(48, dtype=torch.bfloat16)), ["bias", "float32", "bias.float()"]),
    (dict(bias=torch.ones(47)), ["bias", "[N] = [48]"]),
    (dict(config=4), ["config", "0..3", "cooperative"]),
    (dict(config=True), ["config"]),
]
BLOCKWISE_BAD = [
    (dict(a=torch.zeros(33, 192, dtype=torch.uint8), b=torch.zeros(144, 192, dtype=torch.uint8)),
     ["K = 192", "multiple of 128", "256"]),
    (dict(sa=torch.ones(2, 33)), ["sa", "[M, K/128]", "(33, 2)"]),
    (dict(sb=torch.ones(1, 2)), ["sb", "[ceil(N/128), K/128]", "(2, 2)"]),
    (dict(sb=torch.ones(2, 2, dtype=torch.float64)), ["sb", "float32"]),
    (dict(sa=torch.ones(2, 33).t()), ["sa", "contiguous"]),
    (dict(config=2), ["config", "0..1"]),
]
BAD = ([(pf.fp8_rowwise_gemm, _rowwise_args, *case) for case in ROWWISE_BAD]
       + [(pf.fp8_blockwise_gemm, _blockwise_args, *case) for case in BLOCKWISE_BAD])


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_arguments_are_refused_before_loading(i, no_load):
    fn, make, change, words = BAD[i]
    with pytest.raises(ValueError) as e:
        fn(**{**make(), **change})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("fn, make", [(pf.fp8_rowwise_gemm, _rowwise_args), (pf.fp8_blockwise_gemm, _blockwise_args)])
def test_cpu_tensors_are_refused_with_the_fix(fn, make, no_load):
    with pytest.raises(ValueError, match=r"a is on cpu.*CUDA tensors.*\.cuda\(\)"):
        fn(**make())


@pytest.mark.parametrize("M", [1, 3, 4, 37])
def test_mmajor_scales_is_the_transpose_padded_with_zeros(M, rng):
    sa = torch.rand(M, 3, generator=rng) + 0.5
    t = pf.mmajor_scales(sa)
    ld = -(-M // 4) * 4
    assert t.shape == (3, ld) and t.is_contiguous() and ld % 4 == 0 and ld >= M
    for m in range(M):
        for g in range(3):
            assert t[g, m] == sa[m, g]
    assert not t[:, M:].any()


def test_the_python_tables_describe_the_compiled_ones():
    src = (build.CSRC / build.PREFILL_SOURCE).read_text()
    assert not re.search(rf"^using Row{len(pf.ROWWISE_CONFIGS)} =", src, re.M)
    assert not re.search(rf"^using Block{len(pf.BLOCKWISE_CONFIGS)} =", src, re.M)
    for tag, table in (("Row", pf.ROWWISE_CONFIGS), ("Block", pf.BLOCKWISE_CONFIGS)):
        for i, c in enumerate(table):
            line = re.search(rf"^using {tag}{i} = .*$", src, re.M).group(0)
            tile = "T256" if c.tile[1] == 256 else "T128"
            assert f"<{tile}, C{c.cluster[0]}{c.cluster[1]}," in line, (line, c)
            assert ("Pingpong" in line) == (c.schedule == "pingpong") and ("FastAccum" in line) == c.fast_accum, line


# ---- the build (no GPU) ------------------------------------------------------------------------------------

def _toolchain_and_cutlass_or_skip():
    for found in (build.find_toolchain(), build.find_cutlass()):
        if isinstance(found, str):
            if os.environ.get("CI"):
                pytest.fail(f"CI must compile the prefill GEMMs: {found} (scripts/setup.sh installs both)")
            pytest.skip(found)


def test_prefill_library_compiles_for_sm90a_loads_and_refuses_on_the_c_side():
    _toolchain_and_cutlass_or_skip()
    path = build.build_prefill_library(progress=lambda s: None)   # every configuration: what ships
    lib = library._declare(ctypes.CDLL(str(path)), library.PREFILL_SIGNATURES)   # loads without a driver
    assert lib.lb_prefill_abi_version() == library.PREFILL_ABI_VERSION
    assert [lib.lb_prefill_configs(bw) for bw in (0, 1)] == [len(pf.ROWWISE_CONFIGS), len(pf.BLOCKWISE_CONFIGS)]
    # refusals that return before any CUDA call (the null pointers are never touched)
    row = lambda M, N, K, cfg: lib.lb_fp8_rowwise_gemm(None, None, None, None, None, None, M, N, K, cfg, None)  # noqa: E731
    assert row(0, 16, 16, 0) == -1 and row(8, 16, 24, 0) == -2 and row(8, 24, 16, 0) == -2
    assert row(8, 16, 16, len(pf.ROWWISE_CONFIGS)) == -3 and row(8, 16, 16, -1) == -3
    blk = lambda M, N, K, ld, cfg: lib.lb_fp8_blockwise_gemm(None, None, None, ld, None, None, None, M, N, K, cfg,  # noqa: E731
                                                              None)
    assert blk(8, 16, 0, 8, 0) == -1 and blk(8, 16, 192, 8, 0) == -2 and blk(8, 40, 128, 8, 0) == -2
    assert blk(8, 16, 128, 6, 0) == -4 and blk(8, 16, 128, 4, 0) == -4
    assert blk(8, 16, 128, 8, len(pf.BLOCKWISE_CONFIGS)) == -3


def test_prefill_unavailable_reason_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("LOWBIT_PREFILL_LIB", str(tmp_path / "missing.so"))
    assert "LOWBIT_PREFILL_LIB" in library.prefill_unavailable_reason()
    monkeypatch.delenv("LOWBIT_PREFILL_LIB")
    monkeypatch.setenv("LOWBIT_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_cutlass_candidates", lambda: [(tmp_path / "include", tmp_path / "util")])
    reason = library.prefill_unavailable_reason()
    if not isinstance(build.find_toolchain(), str):
        assert "CUTLASS" in reason and "nvidia-cutlass" in reason
    with pytest.raises(RuntimeError, match="prefill GEMMs unavailable"):
        library.load_prefill.__wrapped__()


# ---- on an sm_90 GPU ---------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_SM90 or library.prefill_unavailable_reason() is not None,
                         reason="needs an sm_90 GPU and the prefill library "
                                f"({library.prefill_unavailable_reason() if ON_SM90 else 'no sm_90 GPU'})")
# M not a multiple of any tile, N a multiple of 16 but not of 128, K over several 128-blocks
SHAPES = [(1037, 400, 640), (333, 272, 384), (2048, 144, 1024)]


def _operands(M, N, K, w_scheme, x_scheme, rng, bias: bool):
    w = torch.randn(N, K, generator=rng) * (torch.rand(N, 1, generator=rng) + 0.1)
    x = torch.randn(M, K, generator=rng) * (torch.rand(M, 1, generator=rng) * 3 + 0.1)
    wq, xq = lb.quantize(w, w_scheme), lb.quantize(x, x_scheme)
    b = torch.randn(N, generator=rng) if bias else None
    return xq, wq, b


def _check(y, xq, wq, b):
    v = check_quantized(y.cpu(), xq, wq, bias=None if b is None else b.double(),
                        accumulator=fp8_dot_accumulator("cuda"))
    assert v.passed, v.report()
    return implementation_gate(xq, wq, qlinear_reference(xq, wq, b), accumulator=fp8_dot_accumulator("cuda"),
                               out_dtype=torch.bfloat16, bias=b)


@gpu
@pytest.mark.parametrize("config", range(len(pf.ROWWISE_CONFIGS)))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_rowwise_matches_the_reference_and_triton(config, shape, bias, rng):
    r = get_recipe("w8a8-fp8")
    xq, wq, b = _operands(*shape, r.weight, r.act, rng, bias)
    args = (xq.codes.cuda(), wq.codes.cuda(), xq.scale.float().cuda(), wq.scale.float().cuda())
    bb = None if b is None else b.cuda()
    y = pf.fp8_rowwise_gemm(*args, bias=bb, config=config)
    gate = _check(y, xq, wq, b)
    t = fp8_gemm(*args, bias=bb, out_dtype=torch.bfloat16)
    assert ((y.double() - t.double()).abs().cpu() <= 2 * gate).all()   # each within its gate of the reference


@gpu
@pytest.mark.parametrize("config", range(len(pf.BLOCKWISE_CONFIGS)))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_blockwise_matches_the_reference_and_triton(config, shape, bias, rng):
    xq, wq, b = _operands(*shape, lb.get_preset("fp8_block128"), lb.get_preset("fp8_block1x128"), rng, bias)
    args = (xq.codes.cuda(), wq.codes.cuda(), xq.scale.float().cuda(), wq.scale.float().cuda())
    bb = None if b is None else b.cuda()
    y = pf.fp8_blockwise_gemm(*args, bias=bb, config=config)
    gate = _check(y, xq, wq, b)
    t = fp8_block_gemm(*args, bias=bb)
    assert ((y.double() - t.double()).abs().cpu() <= 2 * gate).all()
