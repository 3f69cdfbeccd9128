"""`lowbit demo`: a quick tour. Prints the element-format table, then quantizes a weight
shaped like a real layer's (rows whose ranges differ by 64x, an outlier every 37th element at
8x its neighbours) to int8 with one scale per tensor, per channel (row) and per group of
32, and shows what each policy costs: relative L2 error, SQNR, and how many of the 255
codes the quietest row actually gets to use.
"""
from __future__ import annotations

import math

import torch

N_ROWS, K = 256, 1024  # weight [N, K]: rows are output channels, scales reduce along K


def gain_spread_weight(n: int = N_ROWS, k: int = K, seed: int = 0) -> torch.Tensor:
    """float32 [n, k]: row r has gain 2^(-6 + 6 r / (n - 1)), so gains span 64x; every 37th
    element (flat index) is multiplied by 8, an outlier among its neighbours."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-6, 0, n, base=2.0).reshape(n, 1)
    w.view(-1)[::37] *= 8
    return w


def compare(w: torch.Tensor) -> list[dict]:
    """One dict per scheme: rel_l2, sqnr_db, worst_row_rel_l2, codes_used (quietest row)."""
    import lowbit as lb

    schemes = [("per-tensor", lb.QuantScheme("int8", "tensor")),
               ("per-channel", lb.get_preset("int8_channel")),
               ("per-group 32", lb.QuantScheme("int8", "group", group_size=32))]
    quiet = int(w.abs().amax(dim=1).argmin())
    out = []
    for label, scheme in schemes:
        qt = lb.quantize(w, scheme)
        err = (qt.dequantize(torch.float64) - w.double())
        rel = float(err.norm() / w.double().norm())
        row_rel = err.norm(dim=1) / w.double().norm(dim=1)
        out.append({"scheme": label, "rel_l2": rel, "sqnr_db": -20 * math.log10(rel),
                    "worst_row_rel_l2": float(row_rel.max()),
                    "codes_used": int(torch.unique(qt.codes[quiet]).numel()), "quiet_row": quiet})
    return out


def _report(rows: list[dict], w: torch.Tensor) -> str:
    import lowbit as lb

    u = lb.get_format("int8").unit_roundoff
    lines = [f"int8 weight [{w.shape[0]} x {w.shape[1]}]: row ranges span 64x, every 37th element an 8x outlier",
             f"{'scales':<14}{'rel L2':>10}{'SQNR dB':>9}{'worst row rel L2':>18}   codes used in the quietest row"]
    for r in rows:
        lines.append(f"{r['scheme']:<14}{r['rel_l2']:>10.3e}{r['sqnr_db']:>9.1f}{r['worst_row_rel_l2']:>18.3e}"
                     f"   {r['codes_used']} of 255")
    gain = rows[0]["worst_row_rel_l2"] / rows[1]["worst_row_rel_l2"]
    lines.append(f"(int8's u = 1/(2*127) = {u:.3e} bounds the error relative to each scale's absmax; one scale "
                 f"for the whole tensor\n leaves the quietest row {gain:.0f}x worse than a scale per row.)")
    return "\n".join(lines)


def plot(w: torch.Tensor, path: str) -> str:
    """PNG: the quietest row's values against the int8 code grid under each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import lowbit as lb

    rows = compare(w)
    quiet = rows[0]["quiet_row"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 5), sharex=False)
    for ax, r, scheme in zip(axes, rows, [lb.QuantScheme("int8", "tensor"), lb.get_preset("int8_channel"),
                                          lb.QuantScheme("int8", "group", group_size=32)]):
        qt = lb.quantize(w, scheme)
        ax.plot(w[quiet].numpy(), qt.dequantize()[quiet].numpy(), ".", ms=2)
        ax.set_title(f"{r['scheme']}: {r['codes_used']} of 255 codes used, row rel L2 "
                     f"{float((qt.dequantize()[quiet] - w[quiet]).norm() / w[quiet].norm()):.2e}", fontsize=9)
        ax.set_ylabel("dequantized")
    axes[-1].set_xlabel(f"original value (row {quiet}, the quietest)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def register(parser) -> None:
    parser.add_argument("--png", "--plot", dest="png", metavar="PATH.png", default=None,
                        help="also write a PNG of the quietest row under each scale policy")


def run(args) -> int:
    from lowbit.entrypoints.formats import format_table

    print(format_table())
    print()
    w = gain_spread_weight()
    print(_report(compare(w), w))
    if getattr(args, "png", None):
        if not args.png.lower().endswith(".png"):
            raise ValueError(f"--png {args.png}: give a path ending in .png")
        print(f"wrote {plot(w, args.png)}")
    return 0
