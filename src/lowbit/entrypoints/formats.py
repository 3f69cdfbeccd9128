"""`lowbit formats [--json]`: the element-format tables (docs/formats.md), computed from the codecs.

Every number printed comes from lowbit.formats' derived properties (codes enumerated
through the decoders), none is typed in here.
"""
from __future__ import annotations

import json
import math
import sys

from lowbit.formats import get_format, list_formats


def rows() -> list[dict]:
    """One dict per format, JSON-ready: the derived properties, codes as hex strings."""
    out = []
    for name in list_formats():
        f = get_format(name)
        row = {"name": f.name, "kind": f.kind, "bits": f.bits, "signed": f.signed, "max": f.max,
               "min_normal": f.min_normal, "min_subnormal": f.min_subnormal,
               "unit_roundoff": f.unit_roundoff}
        if f.kind == "int":
            row.update(qmin=f.qmin, qmax=f.qmax)
        else:
            width = (f.bits + 3) // 4
            row.update(ebits=f.ebits, mbits=f.mbits, bias=f.bias, policy=f.policy,
                       has_inf=f.has_inf, has_nan=f.has_nan,
                       nan_codes=f.nan_codes.hex(width), inf_codes=f.inf_codes.hex(width),
                       num_nan_codes=len(f.nan_codes))
        out.append(row)
    return out


def _num(v: float) -> str:
    """Decimal, plus the power of two when the value is one (most of these are)."""
    m, e = math.frexp(v)
    s = f"{v:.6g}"
    return f"{s} (2^{e - 1})" if m == 0.5 else s


def _table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths)))
             for r in [header] + body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table() -> str:
    """The two aligned text tables (float formats, integer formats) as one string."""
    data = rows()
    floats = [[r["name"], str(r["bits"]), str(r["ebits"]), str(r["mbits"]), str(r["bias"]),
               _num(r["max"]), _num(r["min_normal"]), _num(r["min_subnormal"]),
               _num(r["unit_roundoff"]), r["nan_codes"], r["inf_codes"]]
              for r in data if r["kind"] == "float"]
    ints = [[r["name"], str(r["bits"]), str(r["qmin"]), str(r["qmax"]),
             f"{r['unit_roundoff']:.4g}"] for r in data if r["kind"] == "int"]
    return "\n".join([
        "Float formats (u = 2^-p, p = mbits + 1: the largest relative rounding error of a normal value)",
        _table(["format", "bits", "ebits", "mbits", "bias", "max", "min normal", "min subnormal", "u",
                "NaN codes", "inf codes"], floats),
        "",
        "Integer formats (u = 1/(2*qmax): half a step relative to absmax under s = absmax/qmax)",
        _table(["format", "bits", "qmin", "qmax", "u"], ints),
    ])


def register(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the properties as JSON")
    parser.add_argument("--png", "--plot", dest="png", metavar="PATH.png", default=None,
                        help="also write a PNG of the formats' value grids and relative spacing")


def run(args) -> int:
    if args.json:
        print(json.dumps(rows(), indent=2))
    else:
        print(format_table())
    if args.png:
        if not args.png.lower().endswith(".png"):
            raise ValueError(f"--png {args.png}: give a path ending in .png")
        from lowbit.formats.plot import plot_formats

        # keep stdout pure JSON under --json
        print(f"wrote {plot_formats(args.png)}", file=sys.stderr if args.json else sys.stdout)
    return 0
