"""W4A16 decode GEMM (lowbit.ops.weight_only) against an independent float64 reference.

The reference dequantizes the kernel's own packed bytes with numpy (nibbles, two's
complement, zero points) and ml_dtypes (fp4 e2m1 values, e4m3 scales), so the packing,
the scale layout and the kernel are all checked against code that shares nothing with
lowbit. On the CPU the kernel runs in Triton's interpreter; with CUDA, on the GPU.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.ops.triton.split_k import reduce_split_k
from lowbit.ops.weight_only import dequantize_w4, prepare_w4, w4a16_linear, w4a16_reference
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme, get_preset

U32 = 2.0 ** -24


@pytest.fixture
def device(kernel_device):
    """Kernel tests run where the Triton kernel runs (conftest's kernel_device)."""
    return kernel_device

SCHEMES = {
    "int4_g128": get_preset("int4_g128"),
    "int4_g128_asym": get_preset("int4_g128_asym"),
    "int4_g32": QuantScheme("int4", "group", group_size=32),
    "uint4_g32_asym": QuantScheme("uint4", "group", group_size=32, symmetric=False),
    "mxfp4": get_preset("mxfp4"),
    "nvfp4": get_preset("nvfp4"),
}


def _numpy_codes(w4) -> np.ndarray:
    """The 4-bit codes [N, K] of the kernel's bytes, without lowbit: planar chunks of C codes (low
    nibbles = first half of the chunk, high nibbles = second half), int4 offset-binary."""
    p = w4.packed.cpu().numpy()
    N, C = p.shape[0], w4.chunk
    p = p.reshape(N, -1, C // 2)
    lo, hi = (p & 0xF).astype(np.int64), (p >> 4).astype(np.int64)
    return np.concatenate([lo, hi], axis=-1).reshape(N, -1)


def _numpy_dequant(w4) -> np.ndarray:
    """float64 [N, K] from the kernel's bytes, without lowbit (_numpy_codes' values)."""
    return _code_values(_numpy_codes(w4), w4)


def _code_values(codes: np.ndarray, w4, tensor_scale: bool = True) -> np.ndarray:
    """float64 [N, K] weights of 4-bit codes [N, K] (as stored: int4 offset-binary) with w4's
    scales: numpy for the integers, ml_dtypes for e2m1 values and e4m3 scales (NVFP4: times
    the tensor scale unless tensor_scale=False)."""
    G = w4.group_size
    if w4.kind in ("int4", "uint4"):
        return _int4_values(codes, w4)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = w4.scale_codes.cpu().numpy()
    if w4.kind == "mxfp4":
        s = np.exp2(sc.astype(np.float64) - 127)
    else:
        # QTensor's effective scale is float32(e4m3 value * tensor scale)
        g = np.float32(w4.global_scale.cpu().numpy().reshape(()) if tensor_scale else 1.0)
        s = (sc.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g).astype(np.float64)
    return vals * np.repeat(s, G, axis=1)


def _bound(x64, w64, ref, K, G, split, out_dtype):
    """|out - ref| bound. Every product x_k * w_k the kernel forms is exact (integer or
    6-significant-bit weights), so the error is float32 accumulation: <= K - 1 additions
    inside dots, one scale product per group, split-K partial sums, the NVFP4 tensor scale
    and its e4m3*g rounding: (K + K/G + split + 3) roundings of at most 2u each (2u covers a
    tensor core that truncates instead of rounding), on sum |x||w|. Then one rounding to
    the output dtype (unit roundoff 2^-8 bf16, 2^-11 fp16) of the computed value."""
    s = x64.abs() @ w64.abs().T
    acc = 2 * (K + K // G + split + 3) * U32 * s
    u_out = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    return acc + u_out * (ref.abs() + acc)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_w4a16_against_numpy_reference(name, device, rng):
    scheme = SCHEMES[name]
    # K = 256: int4 groups below 128 pack two groups per chunk (one per nibble plane); K = 288 =
    # 9 x 32 (group 32 and fp4 only): an odd number of groups, so one group per chunk
    for K in (256, 288) if scheme.group_size <= 32 else (256,):
        _check_against_numpy(scheme, K, device, rng)


def _check_against_numpy(scheme, K, device, rng):
    N = 40
    w = torch.randn(N, K, generator=rng) * 0.05
    w[3] = 0  # a zero output channel
    wq = quantize(w, scheme)
    w4 = prepare_w4(wq.to(device), layout="planar_chunks")
    if scheme.format in ("int4", "uint4") and scheme.group_size < 128:
        assert w4.chunk == (2 * scheme.group_size if K % (2 * scheme.group_size) == 0 else scheme.group_size)
    w64 = torch.from_numpy(_numpy_dequant(w4))
    # the prefill path's one-pass dequantization of this layout: (q - z) * s rounded to float32, then
    # once to bf16; fp4 values exact in bf16 (without NVFP4's tensor scale)
    want = w64.float() if scheme.format != "fp4_e2m1fn" else \
        torch.from_numpy(_code_values(_numpy_codes(w4), w4, tensor_scale=False))
    assert torch.equal(dequantize_w4(w4, torch.bfloat16).cpu(), want.to(torch.bfloat16))
    # lowbit's own reference agrees with the independent one exactly
    assert torch.equal(w4a16_reference(torch.eye(K, dtype=torch.float64), wq), w64.T)
    dtypes = [torch.bfloat16] if scheme.format == "fp4_e2m1fn" else [torch.bfloat16, torch.float16]
    for dtype in dtypes:
        for M in (1, 3, 17):
            x = (torch.randn(M, K, generator=rng) * 2).to(dtype)
            out = w4a16_linear(x.to(device), w4, backend="triton")
            assert out.dtype == dtype and out.shape == (M, N)
            ref = x.double() @ w64.T
            err = (out.cpu().double() - ref).abs()
            bound = _bound(x.double(), w64, ref, K, w4.group_size, 1, dtype)
            assert torch.all(err <= bound), f"M={M} {dtype}: max excess {(err - bound).max().item()}"
            assert torch.all(out.cpu()[:, 3] == 0)  # zero weights give exact zeros


@pytest.mark.parametrize("name", ["int4_g128", "int4_g128_asym", "int4_g32", "uint4_g32_asym"])
def test_w4a16_gemv8_against_numpy_reference(name, device, rng):
    """The "gemv8" and "dot8" kernels (planar8 layout: int32 words, nibble p of word t of a group = code
    p * G/8 + t) against the independent numpy dequantization of its own words, at M = 1, 2,
    3 (4-row tiles, rows past M masked) and 17, N not a tile multiple, a zero output channel.
    Its error is the same float32 accumulation as the other kernels' (exact nibble values,
    exact products, per-group scaling): the same bound holds, split-K included."""
    scheme = SCHEMES[name]
    N, K = (40, 256) if scheme.group_size == 128 else (24, 128)  # (the interpreter is slow: small)
    w4, w64 = _prepared_words(scheme, N, K, 5, "planar8", _numpy_dequant_planar8, device, rng)
    cases = [("gemv8", torch.bfloat16, 1, 1), ("gemv8", torch.bfloat16, 3, 1), ("gemv8", torch.bfloat16, 17, 2),
             ("gemv8", torch.float16, 2, 2)]
    if scheme.group_size >= 128:  # dot8: one K = 16 tensor-core step per nibble plane of a group
        cases += [("dot8", torch.bfloat16, 17, 2), ("dot8", torch.float16, 5, 1)]
    for kernel, dtype, M, split in cases:
        x = (torch.randn(M, K, generator=rng) * 2).to(dtype)
        out = w4a16_linear(x.to(device), w4, backend="triton", config={"split": split, "kernel": kernel})
        assert out.dtype == dtype and out.shape == (M, N)
        ref = x.double() @ w64.T
        err = (out.cpu().double() - ref).abs()
        bound = _bound(x.double(), w64, ref, K, w4.group_size, split, dtype)
        assert torch.all(err <= bound), f"{kernel} M={M} {dtype}: max excess {(err - bound).max().item()}"
        assert torch.all(out.cpu()[:, 5] == 0)


def _prepared_words(scheme, N, K, zero_row, layout, numpy_dequant, device, rng):
    """(W4Weight in `layout`, its float64 [N, K] from numpy_dequant) for random weights with
    output channel zero_row all zero; lowbit's own reference must agree exactly."""
    w = torch.randn(N, K, generator=rng) * 0.05
    w[zero_row] = 0
    wq = quantize(w, scheme)
    w4 = prepare_w4(wq.to(device), layout=layout)
    assert w4.metadata()["layout"] == layout
    w64 = torch.from_numpy(numpy_dequant(w4))
    assert torch.equal(w4a16_reference(torch.eye(K, dtype=torch.float64), wq), w64.T)
    return w4, w64


def _int4_values(codes: np.ndarray, w4) -> np.ndarray:
    """float64 (code - offset - z) * s of int4 / uint4 codes [N, K] (int4 stored offset-binary)."""
    G = w4.group_size
    q = codes - 8 if w4.kind == "int4" else codes
    if w4.zero_point is not None:
        q = q - np.repeat(w4.zero_point.cpu().numpy().astype(np.int64), G, axis=1)
    return q * np.repeat(w4.scale.cpu().numpy().astype(np.float64), G, axis=1)


def _numpy_dequant_planar8(w4) -> np.ndarray:
    """float64 [N, K] from planar8 bytes without lowbit: little-endian int32 words; nibble p
    of word t of group c is code c*G + p*(G/8) + t; int4 offset-binary."""
    words = w4.packed.cpu().numpy().view("<u4").astype(np.int64)  # [N, K/8]
    N, G = words.shape[0], w4.group_size
    words = words.reshape(N, -1, G // 8)                                 # [n, c, t]
    nib = np.stack([(words >> (4 * p)) & 15 for p in range(8)], axis=2)  # [n, c, p, t]
    return _int4_values(nib.reshape(N, -1), w4)


@pytest.mark.parametrize("name", ["int4_g128", "int4_g128_asym", "int4_g32", "uint4_g64_asym", "mxfp4", "nvfp4"])
def test_w4a16_pairs_against_numpy_reference(name, device, rng):
    """The "pairs" kernel (tensor cores fed from registers; its words relabelled in-kernel to the
    mma operand order, x relabelled to match for the mma v2 tiles) against the numpy
    dequantization of its own words: M = 1 and 3 (mma v2 order, x relabelled), 17 (wgmma
    order on the GPU), split-K, fp16, a 64-row tile with 4 warps (the GPU's row relabelling),
    N not a tile multiple, a zero output channel. Same error bound as the other kernels
    (exact q - z, exact products, float32 accumulation, one scale product per group). fp4
    (bf16 activations only): e2m1 values built in packed bf16 on the GPU, MXFP4's block = one
    plane, NVFP4's two blocks per plane, both folded into the bf16 weights, NVFP4's tensor scale at the end."""
    scheme = SCHEMES[name] if name in SCHEMES else QuantScheme("uint4", "group", group_size=64, symmetric=False)
    N, K = 40, 256
    w4, w64 = _prepared_words(scheme, N, K, 6, "pairs", _numpy_dequant_pairs, device, rng)
    fp4 = scheme.format == "fp4_e2m1fn"
    if fp4:  # the prefill path's dequantization: e2m1 * block scale, exact in bf16 (no tensor scale)
        blocks = _numpy_dequant_pairs(w4, tensor_scale=False)
        assert torch.equal(dequantize_w4(w4, torch.bfloat16).cpu().double(), torch.from_numpy(blocks))
    else:  # (q - z) * s rounded to float32, then once to bf16
        assert torch.equal(dequantize_w4(w4, torch.bfloat16).cpu(), w64.float().to(torch.bfloat16))
    half = torch.bfloat16 if fp4 else torch.float16  # fp4 weights take bf16 activations only
    cases = [(torch.bfloat16, 1, {}), (torch.bfloat16, 3, {"split": 2}), (torch.bfloat16, 17, {"BLOCK_K": 256}),
             (half, 2, {"BLOCK_N": 64, "num_warps": 4}), (torch.bfloat16, 5, {"BLOCK_N": 64, "num_warps": 4,
                                                                              "BLOCK_M": 16}),
             (torch.bfloat16, 2, {"BLOCK_K": 128, "split": 2}), (half, 17, {"BLOCK_K": 128}),
             # the L1 prefetch of the next step's x (GPU only; the interpreter runs without it): rows
             # past M clamped to the last real one, at an mma v2 and a 64-row wgmma tile
             (torch.bfloat16, 5, {"xpf": 1}), (half, 33, {"xpf": 1, "split": 2})]
    for dtype, M, cfg in cases:
        x = (torch.randn(M, K, generator=rng) * 2).to(dtype)
        out = w4a16_linear(x.to(device), w4, backend="triton", config=cfg or None)
        assert out.dtype == dtype and out.shape == (M, N)
        ref = x.double() @ w64.T
        err = (out.cpu().double() - ref).abs()
        # split-K: the config's, else the heuristic's (1 in the interpreter; 8 bounds the GPU's here)
        bound = _bound(x.double(), w64, ref, K, w4.group_size, cfg.get("split", 8), dtype)
        assert torch.all(err <= bound), f"pairs M={M} {dtype} {cfg}: max excess {(err - bound).max().item()}"
        assert torch.all(out.cpu()[:, 6] == 0)
        if cfg.get("split", 1) > 1:  # split-K sums the partials in a fixed order: a second call, bit for bit
            assert torch.equal(w4a16_linear(x.to(device), w4, backend="triton", config=cfg), out)


def _numpy_dequant_pairs(w4, tensor_scale: bool = True) -> np.ndarray:
    """float64 [N, K] from "pairs" bytes without lowbit: little-endian int32 words, 16 per chunk
    of 128 codes; word w holds, for plane i (codes 32i..32i+31 of the chunk), code 2P of the
    plane in nibble i and code 2P + 1 in nibble i + 4, P = w2 + 2 w3 + 4 w0 + 8 w1."""
    words = w4.packed.cpu().numpy().view("<u4").astype(np.int64)       # [N, K/8]
    N = words.shape[0]
    words = words.reshape(N, -1, 16)                                     # [n, c, w]
    codes = np.zeros((N, words.shape[1], 128), dtype=np.int64)
    for w in range(16):
        b = [(w >> k) & 1 for k in range(4)]
        P = b[2] + 2 * b[3] + 4 * b[0] + 8 * b[1]
        for i in range(4):
            codes[:, :, 32 * i + 2 * P] = (words[:, :, w] >> (4 * i)) & 15
            codes[:, :, 32 * i + 2 * P + 1] = (words[:, :, w] >> (16 + 4 * i)) & 15
    return _code_values(codes.reshape(N, -1), w4, tensor_scale)


def test_w4a16_pairs_errors(rng):
    wq = quantize(torch.randn(16, 128, generator=rng), SCHEMES["int4_g128"])
    with pytest.raises(NotImplementedError, match="'pairs'"):
        prepare_w4(quantize(torch.randn(16, 160, generator=rng), SCHEMES["mxfp4"]), layout="pairs")
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        prepare_w4(quantize(torch.randn(16, 96, generator=rng), SCHEMES["int4_g32"]), layout="pairs")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 128, generator=rng).to(torch.bfloat16).to(dev)
    w4 = prepare_w4(wq.to(dev), layout="pairs")
    with pytest.raises(ValueError, match="multiple of 16 \\* num_warps"):
        w4a16_linear(x, w4, backend="triton", config={"BLOCK_N": 32, "num_warps": 4})
    with pytest.raises(ValueError, match="'ahead'.*not known"):
        w4a16_linear(x, w4, backend="triton", config={"ahead": 2})
    with pytest.raises(ValueError, match="runs kernel 'pairs'"):
        w4a16_linear(x, w4, backend="triton", config={"kernel": "dot"})
    with pytest.raises(ValueError, match="layout='pairs'"):
        w4a16_linear(x, prepare_w4(wq.to(dev), layout="planar_chunks"), backend="triton", config={"kernel": "pairs"})


def test_w4a16_gemv8_errors(rng):
    wq = quantize(torch.randn(16, 128, generator=rng), SCHEMES["int4_g128"])
    with pytest.raises(NotImplementedError, match="planar8"):
        prepare_w4(quantize(torch.randn(16, 128, generator=rng), SCHEMES["mxfp4"]), layout="planar8")
    with pytest.raises(ValueError, match="layout must be"):
        prepare_w4(wq, layout="planar4")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 128, generator=rng).to(torch.bfloat16).to(dev)
    with pytest.raises(ValueError, match="layout='planar8'"):
        w4a16_linear(x, prepare_w4(wq.to(dev), layout="planar_chunks"), backend="triton", config={"kernel": "gemv8"})
    with pytest.raises(ValueError, match="runs kernels 'gemv8' or 'dot8'"):
        w4a16_linear(x, prepare_w4(wq.to(dev), layout="planar8"), backend="triton", config={"kernel": "dot"})


def test_w4a16_split_k_bias_and_batch_dims(device, rng):
    scheme = SCHEMES["int4_g32"]
    N, K = 24, 512
    w = torch.randn(N, K, generator=rng)
    w4 = prepare_w4(quantize(w, scheme).to(device), layout="planar_chunks")
    w64 = torch.from_numpy(_numpy_dequant(w4))
    bias = torch.randn(N, generator=rng).to(torch.bfloat16)
    x = torch.randn(2, 3, K, generator=rng).to(torch.bfloat16)
    w8 = prepare_w4(quantize(w, scheme).to(device), layout="planar8")
    assert torch.equal(torch.from_numpy(_numpy_dequant_planar8(w8)), w64)
    for split, kernel in ((1, "dot"), (4, "dot"), (2, "gemv"), (1, "gemv8"), (4, "gemv8")):
        out = w4a16_linear(x.to(device), w8 if kernel == "gemv8" else w4, bias.to(device), backend="triton",
                           config={"split": split, "kernel": kernel, "BLOCK_M": 2, "BLOCK_K": 128})
        assert out.shape == (2, 3, N)
        ref = x.double().reshape(-1, K) @ w64.T + bias.double()
        bound = _bound(x.double().reshape(-1, K), w64, ref, K, 32, split, torch.bfloat16)
        bound = bound + 2 * U32 * bias.double().abs()  # the bias add
        assert torch.all((out.cpu().double().reshape(-1, N) - ref).abs() <= bound)
        if split > 1:  # the partials are summed in a fixed order (no atomics): a second call, bit for bit
            again = w4a16_linear(x.to(device), w8 if kernel == "gemv8" else w4, bias.to(device), backend="triton",
                                 config={"split": split, "kernel": kernel, "BLOCK_M": 2, "BLOCK_K": 128})
            assert torch.equal(out, again)


def _ordered_sum(part):
    """((p0 + p1) + p2) + ... in float32, in torch."""
    y = part[0].clone()
    for p in part[1:]:
        y += p
    return y


@pytest.mark.parametrize("split,dtype", [(2, torch.bfloat16), (3, torch.float16), (5, torch.bfloat16)])
def test_split_k_reduction_order(device, rng, split, dtype):
    """reduce_split_k is ((p0 + p1) + p2) + ... in float32, + bias, one round-to-nearest-even: the
    same float32 operations in torch give the same bits (odd M and N: masked tile edges)."""
    M = 2 * int(torch.randint(1, 20, (1,), generator=rng)) + 1
    N = 2 * int(torch.randint(20, 90, (1,), generator=rng)) + 1
    part = torch.randn(split, M, N, generator=rng) * torch.logspace(-3, 3, N)   # magnitudes apart: sums round
    bias = torch.randn(N, generator=rng).to(dtype)
    want = (_ordered_sum(part) + bias.float()).to(dtype)
    assert torch.equal(reduce_split_k(part.to(device), bias.to(device), dtype).cpu(), want)
    assert torch.equal(reduce_split_k(part.to(device), None, dtype).cpu(), _ordered_sum(part).to(dtype))


@pytest.mark.parametrize("name", ["int4_g128", "int4_g128_asym", "int4_g32", "mxfp4", "nvfp4"])
def test_w4a16_decode_sizes_on_gpu(device, rng, name):
    """The decode shapes of the benchmark, scaled down, with the GPU's own heuristics (the pairs
    kernel for every format: per-format tiles, register caps and the x prefetch at 64 rows; 40 rows
    = a 64-row tile with padding rows). One test per format: each compiles a dozen kernels."""
    if device != "cuda":
        pytest.skip("full-size tiles and split-K heuristics are exercised on CUDA only")
    N, K = 2048, 4096
    wq = quantize(torch.randn(N, K, generator=rng).cuda() * 0.02, SCHEMES[name])
    w4 = prepare_w4(wq, layout="planar_chunks")
    w64 = torch.from_numpy(_numpy_dequant(w4))
    w8 = prepare_w4(wq, layout="planar8") if name.startswith("int4_g128") else None
    wp = prepare_w4(wq, layout="pairs")
    for M in (1, 16, 40, 64):
        x = torch.randn(M, K, generator=rng).to(torch.bfloat16)
        ref = x.double() @ w64.T
        bound = _bound(x.double(), w64, ref, K, w4.group_size, 8, torch.bfloat16)
        out = w4a16_linear(x.cuda(), w4)
        assert torch.all((out.cpu().double() - ref).abs() <= bound), (name, M)
        # the "pairs" kernel with its heuristic (mma v2 at M = 1, wgmma at 16 / 64)
        for xs in (x, x.to(torch.float16)) if name.startswith("int4") else (x,):  # fp4: bf16 x only
            refp = xs.double() @ w64.T
            outp = w4a16_linear(xs.cuda(), wp)
            bp = _bound(xs.double(), w64, refp, K, w4.group_size, 8, xs.dtype)
            assert torch.all((outp.cpu().double() - refp).abs() <= bp), (name, M, "pairs", xs.dtype)
        if w8 is not None:  # gemv8 (M = 1) / dot8 (16, 64) with their heuristic (inline-PTX lop3)
            out = w4a16_linear(x.cuda(), w8)
            assert torch.all((out.cpu().double() - ref).abs() <= bound), (name, M, "planar8")
            if M > 1:  # dot8 with packed 16-bit pair unpacking (inline PTX: GPU only)
                out = w4a16_linear(x.cuda(), w8, config={"kernel": "dot8", "unpack": 1})
                assert torch.all((out.cpu().double() - ref).abs() <= bound), (name, M, "dot8 unpack 1")
                xh = x.to(torch.float16)
                refh = xh.double() @ w64.T
                outh = w4a16_linear(xh.cuda(), w8, config={"kernel": "dot8", "unpack": 1})
                bh = _bound(xh.double(), w64, refh, K, w4.group_size, 8, torch.float16)
                assert torch.all((outh.cpu().double() - refh).abs() <= bh), (name, M, "dot8 unpack 1 fp16")


def test_torch_backend_and_errors(rng):
    N, K = 16, 128
    wq = quantize(torch.randn(N, K, generator=rng), SCHEMES["int4_g128"])
    assert prepare_w4(wq).layout == "pairs"  # the default for int4 with K % 128 == 0 ("auto")
    assert prepare_w4(quantize(torch.randn(N, 96, generator=rng), SCHEMES["int4_g32"])).layout == "planar_chunks"
    w4 = prepare_w4(wq, layout="planar_chunks")
    x = torch.randn(2, K, generator=rng).to(torch.bfloat16)
    ref = x.double() @ torch.from_numpy(_numpy_dequant(w4)).T
    out = w4a16_linear(x, w4, backend="torch")
    assert torch.all((out.double() - ref).abs() <= _bound(x.double(), torch.from_numpy(_numpy_dequant(w4)),
                                                          ref, K, 128, 1, torch.bfloat16))
    assert w4.metadata()["layout"] == "planar_chunks" and w4.metadata()["chunk"] == 128
    with pytest.raises(ValueError, match="last dim must be K"):
        w4a16_linear(torch.randn(2, K + 2).to(torch.bfloat16), w4)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        w4a16_linear(torch.randn(2, K), w4)
    with pytest.raises(NotImplementedError, match="no kernel"):
        prepare_w4(quantize(torch.randn(N, K, generator=rng), get_preset("mxfp8")))
    with pytest.raises(NotImplementedError, match="not per-group"):
        prepare_w4(quantize(torch.randn(N, K, generator=rng), QuantScheme("int4", "channel")))
    wq16 = quantize(torch.randn(N, 64, generator=rng), QuantScheme("int4", "group", group_size=16))
    with pytest.raises(NotImplementedError, match="group_size 16"):
        prepare_w4(wq16)
    w_fp4 = prepare_w4(quantize(torch.randn(N, K, generator=rng), SCHEMES["mxfp4"]))
    with pytest.raises(TypeError, match="bfloat16 activations"):
        w4a16_linear(torch.randn(2, K).to(torch.float16), w_fp4)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's device (interpreter on CPU)
    with pytest.raises(ValueError, match="does not divide K"):
        w4a16_linear(x.to(dev), prepare_w4(wq.to(dev), layout="planar_chunks"), backend="triton", config={"split": 3})


def test_kernels_compile_for_sm90():
    """Triton's interpreter cannot see GPU-only failures (constexpr rules, shared memory).
    Compile the fused quantizer and the W4A16 configurations pick_config chooses for the
    decode shapes for sm_90 with Triton's bundled ptxas (no GPU needed), in a process
    without TRITON_INTERPRET, and require each to fit the H200's 232448 bytes per block."""
    import json

    from lowbit.bench.sm90 import fresh_process

    proc = fresh_process(["-m", "lowbit.bench.memory", "--sass"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) >= 17, proc.stdout[-2000:]
    for r in rows:
        assert isinstance(r["sass_static"], int) and r["sass_static"] > 0, r
        assert isinstance(r["shared"], int) and r["shared"] <= 232448, r


def test_mxfp4_scale_range(device, rng):
    """The planar kernel forms e2m1 value * 2^-14 and scale * 2^14 (both exact): MXFP4 scales up
    to 2^113 (e8m0 code 240) run within the same bound as any weight; one code more is refused
    at prepare time instead of overflowing to inf. The pairs kernel (the default layout at K %
    128 == 0) scales its float32 dots by 2^(code - 127): no limit below the NaN code."""
    N, K = 24, 128
    w = torch.randn(N, K, generator=rng)
    w[:, 0] = 3.0  # an amax in [3, 4) in every row: the largest code is known relative to `base`
    base = int(quantize(w, SCHEMES["mxfp4"]).scale_codes.max())
    for top, layout, numpy_dequant in ((240, "planar_chunks", _numpy_dequant), (250, "pairs", _numpy_dequant_pairs)):
        wq = quantize(w * 2.0 ** (top - base), SCHEMES["mxfp4"])  # scales times a power of two: codes shift
        assert int(wq.scale_codes.max()) == top
        w4 = prepare_w4(wq.to(device), layout=layout)
        w64 = torch.from_numpy(numpy_dequant(w4))
        x = (torch.randn(3, K, generator=rng) * 2.0 ** -(100 + top - 240)).to(torch.bfloat16)  # finite outputs
        out = w4a16_linear(x.to(device), w4, backend="triton").cpu().double()
        ref = x.double() @ w64.T
        assert torch.isfinite(out).all() and torch.all((out - ref).abs() <= _bound(x.double(), w64, ref, K, 32, 1,
                                                                                  torch.bfloat16)), layout
    with pytest.raises(ValueError, match="beyond the kernel's exact range"):
        prepare_w4(quantize(w * 2.0 ** (241 - base), SCHEMES["mxfp4"]), layout="planar_chunks")


def test_mxfp4_folded_scales_range(device, rng):
    """MXFP4 in the pairs kernel folds each block's 2^(E - 127) into the bf16 weights through one
    offset D per tensor (W4Weight.fp4_exp_offset): every block must keep E + D <= 254 and every
    block with a nonzero code E + D >= 128, else (scales spread over more than 2^126) D is None and
    the kernel scales each block's float32 dot instead. Both paths against the numpy reference,
    rows scaled by 2^-75 .. 2^75 (every product and output a normal float32)."""
    N, K = 24, 256
    for spread, folded in ((40, True), (150, False)):
        w = torch.randn(N, K, generator=rng)
        w[5] = 0                                     # an all-zero row: its blocks may break the >= 128 rule
        f = torch.linspace(-spread / 2, spread / 2, N).round()
        wq = quantize(w * torch.exp2(f)[:, None], SCHEMES["mxfp4"])
        w4 = prepare_w4(wq.to(device), layout="pairs")
        assert (w4.fp4_exp_offset is not None) == folded, (spread, w4.fp4_exp_offset)
        if folded:
            e = wq.scale_codes.to(torch.int64) + w4.fp4_exp_offset
            nz = (wq.codes.to(torch.int64) & 7).reshape(N, K // 32, 32).amax(dim=2) > 0
            assert int(e.max()) <= 254 and int(e[nz].min()) >= 128 and w4.fp4_exp_offset <= 252
        w64 = torch.from_numpy(_numpy_dequant_pairs(w4))
        x = torch.randn(3, K, generator=rng).to(torch.bfloat16)
        for cfg in (None, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4}):
            out = w4a16_linear(x.to(device), w4, backend="triton", config=cfg).cpu().double()
            ref = x.double() @ w64.T
            assert torch.isfinite(out).all() and torch.all(out[:, 5] == 0)
            assert torch.all((out - ref).abs() <= _bound(x.double(), w64, ref, K, 32, 8, torch.bfloat16)), (spread, cfg)


def test_scale_output_matches_torch(device, rng):
    """scale_output (the large-M path's NVFP4 tensor scale, one pass) equals the torch sequence it
    replaces -- y.float() * s (+ bias.float()), rounded once to y's dtype -- bit for bit: one scale
    or one per column, with and without bias, bf16 and fp16, a shape that is no tile multiple."""
    from lowbit.ops.weight_only import scale_output

    M, N = 37, 300
    for dtype in (torch.bfloat16, torch.float16):
        y = (torch.randn(M, N, generator=rng) * 4).to(dtype)
        for s in (torch.rand(1, generator=rng) + 0.5, torch.rand(N, generator=rng) * 3):
            for bias in (None, torch.randn(N, generator=rng).to(dtype)):
                want = y.float() * s
                if bias is not None:
                    want = want + bias.float()
                got = scale_output(y.to(device), s.to(device), None if bias is None else bias.to(device))
                assert got.dtype == dtype and torch.equal(got.cpu(), want.to(dtype))


@pytest.mark.parametrize("name", ["int4_g128_asym", "nvfp4"])
def test_pairs_dequant_chunks_per_program(name, device, rng, monkeypatch):
    """The pairs dequantization with several 128-code chunks per program (w4a16.configs.PAIRS_DEQUANT)
    gives the same bits as one chunk per program, and as the numpy dequantization of the words
    (int4: rounded once to bf16; fp4: exact); K = 640 = 5 chunks, so 4 per program falls back to 1."""
    from lowbit.ops.w4a16 import configs

    N, K = 24, 640
    w4, w64 = _prepared_words(SCHEMES[name], N, K, 3, "pairs", _numpy_dequant_pairs, device, rng)
    want = torch.from_numpy(_numpy_dequant_pairs(w4, tensor_scale=False)).float().to(torch.bfloat16)
    for chunks in (1, 4, 5):
        cfg = (16, chunks, 4)
        monkeypatch.setattr(configs, "PAIRS_DEQUANT_INTERP", cfg)
        monkeypatch.setattr(configs, "PAIRS_DEQUANT", (64, chunks, 4))
        assert torch.equal(dequantize_w4(w4, torch.bfloat16).cpu(), want), cfg


@pytest.mark.parametrize("block_k,split,prefetch", [(128, 1, True), (256, 2, True), (512, 1, False)])
def test_pairs_load_probe_reads_every_word(rng, device, block_k, split, prefetch):
    """lowbit.bench.w4_probe (the pairs kernel's weight-load pattern alone, for the GPU's bandwidth
    question) folds exactly the words it claims: each row's XOR over each split of K, against numpy,
    at N that is no multiple of the tile and the words' full int32 range."""
    from lowbit.bench.w4_probe import probe
    N, K = 37, 1024
    words = torch.randint(-2**31, 2**31 - 1, (N, K // 8), generator=rng, dtype=torch.int64).to(torch.int32)
    got = probe(words.to(device), 16, block_k, split, prefetch, num_warps=1).cpu().numpy()
    want = np.bitwise_xor.reduce(words.numpy().reshape(N, split, -1), axis=2).T
    assert got.shape == (split, N) and np.array_equal(got, want)
