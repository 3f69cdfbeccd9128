"""PNG of the element formats' value grids (for `lowbit formats --plot PATH`).

Left: every positive finite value of each <= 8-bit float format on a log2 axis (one row per
format), so range and density are seen at a glance. Right: the relative step to the next
value, (v_next - v) / v, against v; half of its peak over the normal range is the format's
unit roundoff u, and the climb below min_normal is the subnormal range losing precision.
"""
from __future__ import annotations

import math

from . import get_format, list_formats

XLIM = 20  # log2 range shown; e8m0's 2^-127..2^127 is clipped (and says so)


def plot_formats(path: str) -> str:
    """Write the figure to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in list_formats() if get_format(n).kind == "float" and get_format(n).bits <= 8]
    fig, (ax_v, ax_s) = plt.subplots(1, 2, figsize=(14, 0.55 * len(names) + 2.0))
    for row, name in enumerate(names):
        f = get_format(name)
        top = 1 << (f.bits - 1) if f.signed else 1 << f.bits
        vals = sorted({v for v in (f.spec.decode_code(c) for c in range(top)) if math.isfinite(v) and v > 0})
        logs = [math.log2(v) for v in vals]
        ax_v.vlines(logs, row - 0.35, row + 0.35, linewidth=0.6)
        label = f"max {f.max:g}" if logs[-1] < XLIM else f"2^{logs[0]:.0f}..2^{logs[-1]:.0f} (clipped)"
        ax_v.text(min(logs[-1], XLIM - 7) + 0.5, row, label, va="center", fontsize=7,
                  bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        steps = [(b - a) / a for a, b in zip(vals, vals[1:])]
        ax_s.step([math.log2(v) for v in vals[:-1]], steps, where="post", label=f"{name} (u={f.unit_roundoff:g})")
    ax_v.set_xlim(-XLIM, XLIM)
    ax_v.set_yticks(range(len(names)), names)
    ax_v.set_xlabel("log2(value), positive finite values")
    ax_v.set_title("representable values")
    ax_v.invert_yaxis()
    ax_s.set_yscale("log")
    ax_s.set_xlim(-XLIM, XLIM)
    ax_s.set_xlabel("log2(value)")
    ax_s.set_ylabel("relative step to next value")
    ax_s.set_title("relative spacing (2u over the normal range)")
    ax_s.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
