"""Code bugs, each simulated exactly: zero point dropped or with the wrong sign, integer codes with
the wrong signedness, fp8 codes decoded with a twin format, 4-bit nibbles in the wrong order, the
weight read transposed."""
from __future__ import annotations

import dataclasses

import torch

from lowbit.formats import decode
from lowbit.verify.simulate import Hyp, Sim, _q, _side, sides

FP8_TWINS = {"fp8_e4m3fn": ("fp8_e4m3fnuz", "fp8_e5m2"), "fp8_e4m3fnuz": ("fp8_e4m3fn",),
             "fp8_e5m2": ("fp8_e4m3fn", "fp8_e5m2fnuz"), "fp8_e5m2fnuz": ("fp8_e5m2",)}


def code_hypotheses(sim: Sim):
    """Zero point dropped or with the wrong sign; integer codes read with the wrong signedness
    (ROCm/hip-ep#178: unsigned nibbles decoded as signed, off by 8); fp8 codes decoded with a
    twin format (uccl-project/uccl#804: e4m3fnuz bytes read as e4m3fn); packed int4/fp4 nibbles
    in the wrong order (kekzl/imp#722: split halves read as interleaved pairs; amd/Quark#30)."""
    for side, other, qt in sides(sim):
        what = _side(side)
        fmt = qt.scheme.fmt
        if qt.zero_point is not None:
            yield sim.hyp("missing_zero_point_term",
                          f"{what}' zero-point correction z * sum_k {other}_q missing: a per-"
                          f"{'row' if side == 'x' else 'column'} offset proportional to the {_side(other)}' "
                          f"code sums", side, dataclasses.replace(qt, zero_point=None))
            yield sim.hyp("zero_point_wrong_sign", f"{what}' zero point added instead of subtracted",
                          side, dataclasses.replace(qt, zero_point=-qt.zero_point))
        if fmt.kind == "int":
            c = qt.codes.to(torch.int64)
            span = 1 << fmt.bits
            if fmt.signed:
                flip, word = torch.where(c < 0, c + span, c), "unsigned"
            else:
                flip, word = torch.where(c >= span // 2, c - span, c), "signed (two's complement)"
            if not torch.equal(flip, c):
                yield sim.hyp("codes_wrong_signedness", f"{what}' {fmt.bits}-bit codes read as {word} "
                              f"(off by {span} wherever the top bit is set)", side, dataclasses.replace(qt, codes=flip))
        elif fmt.bits == 8:
            for twin in FP8_TWINS.get(fmt.name, ()):
                sch = dataclasses.replace(qt.scheme, format=twin)
                # decoded by hand: a twin format may turn a code into Inf/NaN, which the kernel
                # then propagates (the reference's operand refuses such codes)
                D = decode(qt.codes, sch.fmt).double() * qt.expanded_scale().double()
                pred, gate = sim.linear(X=D) if side == "x" else sim.linear(W=D)
                yield Hyp("fp8_format_confusion", f"{what}' {fmt.name} codes decoded as {twin} "
                          f"({'exponent bias off by one: every value halved or doubled' if twin[:7] == fmt.name[:7] else 'a different exponent/mantissa split'})",
                          pred, gate)
        if fmt.bits == 4:
            K = qt.codes.shape[1]
            for name, perm, how in _nibble_perms(K):
                yield sim.hyp("nibble_order_swapped", f"{what}' packed 4-bit codes unpacked {how}", side,
                              dataclasses.replace(qt, codes=qt.codes[:, perm]))


def _nibble_perms(K: int):
    """K-index maps of nibble-order bugs: pairs swapped (high nibble taken as the first element),
    and split halves of 32-element blocks (low nibbles = 0..15, high = 16..31) read as
    interleaved pairs, and the reverse."""
    out = []
    if K % 2 == 0:
        k = torch.arange(K)
        out.append(("pairs", k ^ 1, "with the high and low nibble swapped"))
    if K >= 32:
        k = torch.arange(K)
        full = (K // 32) * 32
        b, i = k // 32, k % 32
        split_as_inter = torch.where(k < full, 32 * b + (i // 2) + 16 * (i % 2), k)
        inter_as_split = torch.where(k < full, 32 * b + 2 * (i % 16) + i // 16, k)
        out.append(("s2i", split_as_inter, "as interleaved pairs although they are stored as split "
                                            "halves of each 32-element block"))
        out.append(("i2s", inter_as_split, "as split halves of each 32-element block although they are "
                                            "stored as interleaved pairs"))
    return out


def transpose_hypotheses(sim: Sim):
    """Weight codes read as if stored K-major ([K, N]) although they are [N, K] row-major."""
    qt = sim.ctx.wq
    if not _q(qt) or qt.codes.ndim != 2:
        return
    N, K = qt.codes.shape
    if N < 2:
        return
    idx = (torch.arange(K)[None, :] * N + torch.arange(N)[:, None]).reshape(-1)
    codes = qt.codes.reshape(-1)[idx].reshape(N, K)
    yield sim.hyp("weight_read_transposed", "weight codes read as if stored [K, N] (column-major) "
                  "although they are [N, K]: a transposed load", "w", dataclasses.replace(qt, codes=codes))


