"""Bug zoo, second part: quantizer rounding rules, wrapped codes, permuted / transposed scales,
offsets added to the output, and kernels that really accumulate in fp16 / bf16 or run a half-
precision matmul of dequantized values. Each bug is planted by a hand-written kernel (numpy casts,
ml_dtypes, torch.trunc / floor / rand), never by the diagnosis' own simulations; check_linear must
name it FIRST and confirm no other name.
"""
import ml_dtypes
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.verify import check_linear

I8T = lb.QuantScheme(format="int8", strategy="token")
I8C = lb.QuantScheme(format="int8", strategy="channel")
I4G32 = lb.QuantScheme(format="int4", strategy="group", group_size=32)
FP8R = lb.get_preset("fp8_row")


def inputs(rng, M, K, N):
    x = torch.randn(M, K, generator=rng)
    gains = torch.exp(torch.rand(N, 1, generator=rng) * 3.4)   # channels ~30x apart
    return x, torch.randn(N, K, generator=rng) * gains


def int_quant(t, qmax=127, rnd=torch.round, divisor=None, group=None):
    """A hand-written symmetric int quantizer: (codes float32, per-element scales float32)."""
    R, K = t.shape
    g = group or K
    blocks = t.reshape(R, K // g, g)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / float(divisor or qmax), torch.ones_like(amax))
    codes = rnd(blocks / s).clamp(-qmax, qmax)
    return codes.reshape(R, K), s.expand(R, K // g, g).reshape(R, K)


def fp8_quant(t, toward_zero=False):
    """A hand-written e4m3fn rowwise quantizer through ml_dtypes: (decoded elements, scales)."""
    s = t.abs().amax(dim=1, keepdim=True) / 448.0
    v = (t / s).numpy()
    near = v.astype(ml_dtypes.float8_e4m3fn)
    if toward_zero:     # step the magnitude code down where nearest rounded away from zero
        bits = near.view(np.uint8).copy()
        up = np.abs(near.astype(np.float64)) > np.abs(v.astype(np.float64))
        bits[up] -= 1
        near = bits.view(ml_dtypes.float8_e4m3fn)
    return torch.from_numpy(near.astype(np.float32)), s.expand_as(t)


def gemm(X, SX, W, SW, bias=None):
    """The kernel: float64 dot products of the elements (exact for int8 / fp8 elements), times
    both scales in float32, + bias in float32."""
    acc = (X.double() @ W.double().T).float()
    out = acc * SX[:, :1] * SW[:, 0][None, :] if SX.shape[1] and _per_row(SX, SW) else None
    if out is None:
        out = (X.double() * SX.double()) @ (W.double() * SW.double()).T
        out = out.float()
    return out if bias is None else out + bias


def _per_row(SX, SW):
    return bool((SX == SX[:, :1]).all()) and bool((SW == SW[:, :1]).all())


def ref_quant(t, scheme):
    """lowbit's quantization (the correct side): decoded elements and per-element scales."""
    q = lb.quantize(t, scheme)
    return (q.codes.float() if scheme.type == "int" else q.decoded()), q.expanded_scale().float()


# ------------------------------------------------------------------------- planted bugs
def b_quantizer_truncates(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    X, SX = int_quant(x, rnd=torch.trunc)                    # int(x / s): truncation
    return gemm(X, SX, *ref_quant(w, I8C)), x, w, I8T, I8C, None


def b_quantizer_truncates_fp8(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    X, SX = fp8_quant(x)
    W, SW = fp8_quant(w, toward_zero=True)
    return gemm(X, SX, W, SW), x, w, FP8R, FP8R, None


def b_quantizer_rounds_half_away(rng, M, K, N):
    # activations on a half-integer grid with a row maximum of 127: the scale is 1 and every odd
    # half-integer is a tie (C's round() sends 2.5 to 3, round-to-nearest-even to 2)
    x = torch.randint(-254, 255, (M, K), generator=rng).float() / 2
    x[:, 0] = 127.0
    _, w = inputs(rng, M, K, N)
    X, SX = int_quant(x, rnd=lambda v: torch.sign(v) * torch.floor(v.abs() + 0.5))
    return gemm(X, SX, *ref_quant(w, I8C)), x, w, I8T, I8C, None


def b_codes_wrapped_not_clamped(rng, M, K, N):
    # scale amax / 128 and a plain int8 cast (numpy wraps 128 to -128)
    x, w = inputs(rng, M, K, N)
    s = w.abs().amax(dim=1, keepdim=True) / 128.0
    W = torch.from_numpy(np.round((w / s).numpy()).astype(np.int16).astype(np.int8).astype(np.float32))
    return gemm(*ref_quant(x, I8T), W, s.expand_as(w)), x, w, I8T, I8C, None


def b_scale_rule_differs(rng, M, K, N):
    # torchao's symmetric int8 rule: scale amax / 127.5, codes round(x * (1 / s)) in [-128, 127]
    x, w = inputs(rng, M, K, N)
    s = x.abs().amax(dim=1, keepdim=True) / 127.5
    X = torch.round(x * (1.0 / s)).clamp(-128, 127)
    return gemm(X, s.expand_as(x), *ref_quant(w, I8C)), x, w, I8T, I8C, None


def b_output_offset(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    return gemm(*ref_quant(x, I8T), *ref_quant(w, I8C)) + 1.0, x, w, I8T, I8C, None


def b_output_offset_per_column(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    v = torch.randn(N, generator=rng)                        # a vector nobody asked for
    return gemm(*ref_quant(x, FP8R), *ref_quant(w, FP8R)) + v, x, w, FP8R, FP8R, None


def b_scales_permuted(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    W, SW = ref_quant(w, I8C)
    return gemm(*ref_quant(x, I8T), W, SW.flip(0)), x, w, I8T, I8C, None     # scale vector reversed


def b_scales_permuted_tokens(rng, M, K, N):
    x, w = inputs(rng, M, K, N)
    x = x * torch.exp(torch.randn(M, 1, generator=rng))
    X, SX = ref_quant(x, I8T)
    return gemm(X, SX.roll(1, 0), *ref_quant(w, I8C)), x, w, I8T, I8C, None   # shifted by one row


def b_scale_grid_transposed(rng, M, K, N):
    K = 32 * (K // 32) + 64
    x, w = inputs(rng, M, K, N)
    w = w * torch.exp2(torch.randint(-3, 4, (N, K // 32), generator=rng).float()).repeat_interleave(32, 1)
    q = lb.quantize(w, I4G32)
    G = K // 32
    grid = q.scale.reshape(-1).reshape(G, N).T                 # element (n, g) fetched at g * N + n
    return gemm(*ref_quant(x, I8T), q.codes.float(), grid.repeat_interleave(32, 1)), x, w, I8T, I4G32, None


ZOO = {name[2:]: fn for name, fn in globals().items() if name.startswith("b_")}
NAME = {k: k.removesuffix("_fp8").removesuffix("_tokens") for k in ZOO}
ONE_ROW_OK = {"scales_permuted_tokens"}            # one row: nothing to permute, the output is right
ONE_ROW_OPEN = {"output_offset_per_column"}        # one row: a per-column offset fits any error
SHAPES = [(13, 200, 21), (1, 300, 17), (37, 259, 10)]


@pytest.mark.parametrize("bug", sorted(ZOO))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_planted_bug_is_named_first_and_no_other_name_is_confirmed(rng, bug, shape):
    out, x, w, xs, ws, b = ZOO[bug](rng, *shape)
    v = check_linear(out, x, w, x_scheme=xs, w_scheme=ws, bias=b)
    if shape[0] == 1 and bug in ONE_ROW_OK:
        assert v.passed, v.report()
        return
    if shape[0] == 1 and bug in ONE_ROW_OPEN:     # failed, and no bug claimed as reproduced
        assert not v.passed and not [c for c in v.causes if c.confirmed], v.report()
        return
    assert not v.passed and v.kind == "logic", v.report()
    assert v.causes[0].name == NAME[bug] and v.causes[0].confirmed, v.report()
    wrong = [c.name for c in v.causes if c.confirmed and c.name != NAME[bug]]
    assert not wrong, v.report()
