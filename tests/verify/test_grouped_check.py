"""check_grouped_linear against an emulated grouped kernel (this file's own code: scale words
built by lowbit.ops.grouped's layouts, element codes decoded by ml_dtypes) with one planted
bug at a time: the verdict must fail and name the planted bug first."""
import ml_dtypes
import numpy as np
import pytest
import torch

import lowbit as lb
from lowbit.ops.grouped import read_sfa, read_sfb, sfa_words, sfb_words, sort_tokens
from lowbit.verify.grouped import check_grouped_linear

MX = lb.get_preset("mxfp8")
INT8_W = lb.QuantScheme(format="int8", strategy="channel")
INT8_X = lb.QuantScheme(format="int8", strategy="token", dynamic=True)
FP8_ROW = lb.get_preset("fp8_row")
INT4_G32 = lb.QuantScheme(format="int4", strategy="group", group_size=32)
SCHEMES = {"mx": (MX, MX), "int8": (INT8_X, INT8_W), "fp8": (FP8_ROW, FP8_ROW), "w4a16": (None, INT4_G32)}


def _counts(rng, E, hot=True, empty=True):
    """Rows per expert: 1..6 each, one expert empty (never the last: an empty last expert shifts
    nothing), one hot (15 rows)."""
    c = torch.randint(1, 7, (E,), generator=rng)
    perm = torch.randperm(E - 1, generator=rng)
    if empty:
        c[perm[0]] = 0
    if hot:
        c[perm[1]] = 15
    return c


def _offsets(c):
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(c, 0)])


def _decode(codes, scheme):
    if scheme.fmt.kind == "int":
        return codes.to(torch.float64)
    return torch.from_numpy(codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def _bytes(words, idx, j):
    return ((words.to(torch.int64)[idx] >> (8 * (j % 4))) & 0xFF).to(torch.float64)


def emulate(x, w, offsets, xs, ws, bug=None, bm=32):
    """A grouped GEMM the way a kernel computes it: sorted rows of expert e (or of the planted
    bug's expert) times its weight; block scales read from SFA / SFB words with the layout's
    index (or the bug's)."""
    E, N, K = w.shape
    M = x.shape[0]
    counts = (offsets[1:] - offsets[:-1]).tolist()
    xq = lb.quantize(x.float(), xs) if xs is not None else None
    wq = [lb.quantize(w[e].float(), ws) for e in range(E)]
    xd = _decode(xq.codes, xs) if xs is not None else None
    wd = torch.stack([_decode(q.codes, ws) for q in wq])
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    k_of = list(range(E))
    if bug == "empty_expert_shift":
        nonempty = [e for e in range(E) if counts[e]]
        k_of = {e: i for i, e in enumerate(nonempty)}
        k_of = [k_of.get(e, e) for e in range(E)]
    k_row = torch.tensor([k_of[int(e)] for e in expert], dtype=torch.int64)
    m = torch.arange(M)
    if xs is not None and xs.scale_format == "e8m0":
        G = K // 32
        A, B = sfa_words(xq.scale_codes), sfb_words(torch.stack([q.scale_codes for q in wq]))
        m_e = torch.tensor(counts)[expert]
        sa = torch.zeros(M, G, dtype=torch.float64)
        sb = torch.zeros(M, N, G, dtype=torch.float64)
        n = torch.arange(N)
        for j in range(G):
            g = j // 4
            ia = {"sfa_local_m": g * m_e + m, "sfa_row_major": m * (G // 4) + g}.get(bug, g * M + m)
            sa[:, j] = 2.0 ** (_bytes(A, ia.clamp(max=A.numel() - 1), j) - 127)
            e_, n_ = k_row[:, None], n[None, :]
            if bug == "sfb_expert_axis":
                ib = g * E * N + n_ * E + e_
            elif bug == "sfb_row_major":
                ib = (e_ * N + n_) * (G // 4) + g
            else:
                e_s = {"scales_of_next": (e_ + 1) % E, "scales_of_prev": (e_ - 1) % E}.get(bug, e_)
                ib = g * E * N + e_s * N + n_
            sb[:, :, j] = 2.0 ** (_bytes(B, ib, j) - 127)
        xg = xd.reshape(M, G, 32)
        wg = wd[k_row].reshape(M, N, G, 32)
        part = torch.einsum("mgk,mngk->mng", xg, wg)
        y = (part * sa[:, None, :] * sb).sum(-1)
    elif xs is None:                    # weight-only groups: fp32 scales, one unit each, flat group-major
        gs = ws.group_size
        G = K // gs
        flat = torch.stack([q.scale.reshape(N, G) for q in wq]).permute(2, 0, 1).reshape(-1).double()
        n_, e_ = torch.arange(N)[None, :], k_row[:, None]
        sb = torch.zeros(M, N, G, dtype=torch.float64)
        for g in range(G):
            if bug == "sfb_expert_axis":
                ib = g * E * N + n_ * E + e_
            elif bug == "sfb_row_major":
                ib = (e_ * N + n_) * G + g
            else:
                e_s = {"scales_of_next": (e_ + 1) % E, "scales_of_prev": (e_ - 1) % E}.get(bug, e_)
                ib = g * E * N + e_s * N + n_
            sb[:, :, g] = flat[ib]
        part = torch.einsum("mgk,mngk->mng", x.double().reshape(M, G, gs), wd[k_row].reshape(M, N, G, gs))
        y = (part * sb).sum(-1)
    else:                               # per-token x per-channel fp32 scales: SFB is the flat [E * N] buffer
        flat = torch.stack([q.scale.reshape(N) for q in wq]).reshape(E * N).double()
        n = torch.arange(N)[None, :]
        e_ = k_row[:, None]
        if bug == "sfb_expert_axis":
            sb = flat[n * E + e_]
        else:
            e_s = {"scales_of_next": (e_ + 1) % E, "scales_of_prev": (e_ - 1) % E}.get(bug, e_)
            sb = flat[e_s * N + n]
        acc = torch.einsum("mk,mnk->mn", xd, wd[k_row])       # exact integers in float64
        y = acc * xq.scale.double().reshape(M, 1) * sb
    if bug == "padding_leak":                                # last expert first: the leaked writes win
        for e in reversed(range(E)):
            lo, hi = int(offsets[e]), int(offsets[e + 1])
            end = min(lo + -(-(hi - lo) // bm) * bm, M)
            if hi > lo and end > hi:
                r = torch.arange(hi, end)
                y[r] = emulate(x[r], w[e:e + 1], torch.tensor([0, end - hi]), xs, ws)
    return y


def _case(rng, E, N, K, **kw):
    c = _counts(rng, E, **kw)
    off = _offsets(c)
    M = int(off[-1])
    x = torch.randn(M, K, generator=rng) * torch.exp(torch.randn(M, 1, generator=rng))
    w = torch.randn(E, N, K, generator=rng) * torch.exp(torch.randn(E, N, 1, generator=rng))
    return x, w, off


@pytest.mark.parametrize("schemes", list(SCHEMES))
def test_correct_grouped_kernel_passes(schemes, rng):
    xs, ws = SCHEMES[schemes]
    x, w, off = _case(rng, 7, 24, 256)
    y = emulate(x, w, off, xs, ws)
    v = check_grouped_linear(y.float(), x, w, off, x_scheme=xs, w_scheme=ws, accumulator=_acc(schemes))
    assert v.passed and v.kind == "ok", v.report()


def _acc(schemes):
    return "fp32" if schemes in ("fp8", "w4a16") else None


MX_BUGS = ["sfb_expert_axis", "sfa_local_m", "sfa_row_major", "sfb_row_major", "scales_of_next", "scales_of_prev",
           "empty_expert_shift", "padding_leak"]
ROW_BUGS = ["sfb_expert_axis", "scales_of_next", "scales_of_prev", "empty_expert_shift", "padding_leak"]
BUGS = {"mx": MX_BUGS, "int8": ROW_BUGS, "fp8": ROW_BUGS, "w4a16": ROW_BUGS + ["sfb_row_major"]}


@pytest.mark.parametrize("bug,schemes", [(b, s) for s, bugs in BUGS.items() for b in bugs])
def test_planted_bug_is_named_first(bug, schemes, rng):
    """Odd expert counts (5, 7), N not a multiple of E, one empty and one hot expert; K = 256 so
    MX scales span two words (with one word group row- and group-major coincide) and int4 groups
    of 32 eight fp32 scale units."""
    xs, ws = SCHEMES[schemes]
    E = 5 if bug != "empty_expert_shift" else 7
    x, w, off = _case(rng, E, 24, 256)
    y = emulate(x, w, off, xs, ws, bug=bug, bm=16)
    v = check_grouped_linear(y.float(), x, w, off, x_scheme=xs, w_scheme=ws, accumulator=_acc(schemes))
    assert not v.passed and v.kind == "logic"
    want = "padding_leak_bm16" if bug == "padding_leak" else bug
    assert v.causes and v.causes[0][0] == want, v.report()


def test_row_major_words_hide_at_one_word_group(rng):
    """The one-word pitfall: with K <= 4 MX groups (one word per row) row-major and group-major
    words coincide, so the bug is invisible there: the layout test needs >= 2 word groups."""
    x, w, off = _case(rng, 5, 24, 128)
    y = emulate(x, w, off, MX, MX, bug="sfa_row_major")
    assert check_grouped_linear(y.float(), x, w, off, x_scheme=MX, w_scheme=MX).passed
    x, w, off = _case(rng, 5, 24, 256)
    y = emulate(x, w, off, MX, MX, bug="sfa_row_major")
    assert not check_grouped_linear(y.float(), x, w, off, x_scheme=MX, w_scheme=MX).passed


def test_scale_layouts_round_trip_and_index(rng):
    """SFA[g * M_total + m] and SFB[g * E * N + e * N + n], element by element."""
    M, E, N, G = 13, 3, 5, 8
    a = torch.randint(0, 255, (M, G), generator=rng, dtype=torch.uint8)
    b = torch.randint(0, 255, (E, N, G), generator=rng, dtype=torch.uint8)
    A, B = sfa_words(a), sfb_words(b)
    for g in range(G // 4):
        for m in range(M):
            word = int(A[g * M + m])
            assert [(word >> (8 * i)) & 0xFF for i in range(4)] == a[m, 4 * g:4 * g + 4].tolist()
        for e in range(E):
            for n in range(N):
                word = int(B[g * E * N + e * N + n])
                assert [(word >> (8 * i)) & 0xFF for i in range(4)] == b[e, n, 4 * g:4 * g + 4].tolist()
    assert torch.equal(read_sfa(A, M, G), a) and torch.equal(read_sfb(B, E, N, G), b)


def test_bad_input_gets_clear_errors(rng):
    x, w, off = _case(rng, 5, 24, 256)
    y = emulate(x, w, off, INT8_X, INT8_W)
    with pytest.raises(ValueError, match="0 rows"):
        check_grouped_linear(y[:0], x[:0], w, torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"offsets must be"):
        check_grouped_linear(y, x, w, off[:-1])
    with pytest.raises(ValueError, match=r"x must be the sorted token buffer"):
        check_grouped_linear(y, x[:-1], w, off)
    with pytest.raises(ValueError, match="K = x.shape"):
        check_grouped_linear(y[:, :], x[:, :200], w[:, :, :200], off, x_scheme=MX, w_scheme=MX)
    with pytest.raises(ValueError, match="top_k = 6"):
        sort_tokens(torch.zeros(3, 6, dtype=torch.long), 5)


def _fp16_sequential(X, W):
    """acc = fp16(acc + fp16(x_k * w_k)) one k at a time, in numpy's float16 arithmetic."""
    a, b = X.numpy().astype(np.float16), W.numpy().astype(np.float16)
    acc = np.zeros((a.shape[0], b.shape[0]), dtype=np.float16)
    for k in range(a.shape[1]):
        acc = (acc + (a[:, k, None] * b[None, :, k]).astype(np.float16)).astype(np.float16)
    return torch.from_numpy(acc.astype(np.float32))


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16 operands", "int4 g32 weights"])
def test_half_accumulation_in_every_expert_is_named_numerical(quantized, rng):
    """A grouped kernel that accumulates each expert's block in fp16 (numpy's float16 here),
    promised fp32: no layout bug reproduces it, the accumulator does, in every expert."""
    E, N, K = 5, 24, 256
    off = _offsets(_counts(rng, E))
    M = int(off[-1])
    x = torch.randn(M, K, generator=rng).bfloat16().float()       # exact in fp16 too (|x| < 2^15)
    w = (torch.randn(E, N, K, generator=rng) * 0.5).bfloat16().float()
    wd = w
    if quantized:       # the kernel reads the canonical int4 codes and scales, dequantized in float32
        wd = torch.stack([(lambda q: q.codes.float() * q.scale.repeat_interleave(32, dim=1))(lb.quantize(w[e], INT4_G32))
                          for e in range(E)])
    y = torch.zeros(M, N)
    for e in range(E):
        lo, hi = int(off[e]), int(off[e + 1])
        if hi > lo:
            y[lo:hi] = _fp16_sequential(x[lo:hi], wd[e])
    v = check_grouped_linear(y, x, w, off, w_scheme=INT4_G32 if quantized else None, accumulator="fp32")
    assert not v.passed and v.kind == "numerical", v.report()
    assert v.causes[0][0] == "accumulator_narrower_than_promised" and "fp16" in v.causes[0][1], v.report()
    assert check_grouped_linear(y, x, w, off, w_scheme=INT4_G32 if quantized else None, accumulator="fp16").passed
