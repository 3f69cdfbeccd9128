"""`lowbit experiment layout`: MX scale layout errors (byte order, row- vs group-major words, granularity).

A block-scaled GEMM (MXFP8 operands, e8m0 scale per 32 K-values) whose consumer reads the B
scales through lowbit.packing's uint32 group-major words (word = b0 | b1<<8 | b2<<16 | b3<<24,
flat index g * rows + r). Three consumer mistakes, as relative L2 against the correct result:
byte order reversed in each word, words read row-major (flat index r * G4 + g), and a
granularity mismatch (consumer assumes one scale per 128 values). And the trap: with one word
group (K <= 4 * 32) row-major and group-major coincide, so the bug hides (seed: True).
"""
from __future__ import annotations

import torch

import lowbit as lb
from lowbit.ops.reference import qlinear_reference
from lowbit.packing import pack_scales, unpack_scales
from lowbit.quantize import e8m0_to_scale
from lowbit.verify.metrics import rel_l2


def _operands(M, K, N, g):
    # block magnitudes spread over 2^-4 .. 2^4 so that different blocks have different scales
    def make(R):
        v = torch.randn(R, K, generator=g)
        return v * torch.exp2(torch.randint(-4, 5, (R, K // 32), generator=g).float()).repeat_interleave(32, dim=1)
    mx = lb.get_preset("mxfp8")
    return lb.quantize(make(M), mx), lb.quantize(make(N), mx)


def _with_scale_codes(qt, codes):
    import dataclasses
    return dataclasses.replace(qt, scale=e8m0_to_scale(codes), scale_codes=codes)


def _byteswap(words):
    w = words.to(torch.int64)
    return (((w & 0xFF) << 24) | (((w >> 8) & 0xFF) << 16) | (((w >> 16) & 0xFF) << 8) | (w >> 24)).to(torch.uint32)


def misreads(wq) -> dict:
    """Scale codes [N, G] a buggy consumer would see, by mistake name."""
    codes = wq.scale_codes
    N, G = codes.shape
    words = pack_scales(codes, layout="group_major")                 # [G/4, N]
    out = {"byte order": unpack_scales(_byteswap(words), "group_major", N, G)}
    out["row-major read"] = unpack_scales(words.reshape(-1).reshape(N, G // 4).t().contiguous(),
                                          "group_major", N, G)
    # consumer indexes scale k // 128 of each row: scale number (k // 128), i.e. code column g // 4
    out["granularity 32 vs 128"] = codes[:, (torch.arange(G) // 4)]
    return out


def run(M: int = 64, K: int = 1024, N: int = 96, seed: int = 0, progress=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    xq, wq = _operands(M, K, N, g)
    good = qlinear_reference(xq, wq)
    rows = []
    for name, codes in misreads(wq).items():
        bad = qlinear_reference(xq, _with_scale_codes(wq, codes))
        rows.append({"mistake": name, "K": K, "rel_l2": rel_l2(bad, good)})
    # one word group: K = 128 -> 4 scales per row -> the row-major read is identical
    xq1, wq1 = _operands(M, 128, N, g)
    same = bool(torch.equal(misreads(wq1)["row-major read"], wq1.scale_codes))
    rows.append({"mistake": "row-major read, one word group (K=128)", "K": 128, "identical": same})
    return {"experiment": "layout", "seed": seed, "rows": rows,
            "notes": ["published: byte order 5.58, row-major 2.47, granularity 2.77, one-group case True; "
                      "layout tests need >= 2 word groups"]}


def format_table(result: dict) -> str:
    lines = [f"{'mistake':<42} {'K':>6} {'rel L2 / hidden':>16}"]
    for r in result["rows"]:
        v = f"{r['rel_l2']:.3f}" if "rel_l2" in r else f"identical={r['identical']}"
        lines.append(f"{r['mistake']:<42} {r['K']:>6} {v:>16}")
    return "\n".join(lines + ["note: " + n for n in result["notes"]])
