"""Reports of `lowbit bench model` rows (lowbit.bench.model): the table printed last and the PNG.
Neither needs a GPU: `python -m lowbit.bench.model_report RUN.json [PNG]` redraws a run."""
from __future__ import annotations

import json
import sys

from lowbit.bench.model_targets import MUST_SHAPE

TICKS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 10)   # speed-up axis labels (log scale)


def columns(rows: list[dict]) -> list[tuple[str, int]]:
    """(phase, batch) in the order the rows list them (the table's and the PNG's columns; the MoE report's too)."""
    return list(dict.fromkeys((r["phase"], r["batch"]) for r in rows))


W = 27   # a cell: ms, tokens/s, speed-up, roof


def _cell(r: dict | None) -> str:
    if r is None:
        return f"{'-':>{W}s}"
    if r.get("ms") is None:
        why = r.get("error") or r.get("skipped") or ""
        return f"{'FAILED' if r.get('error') else 'n/a' if why.startswith('n/a') else 'skipped':>{W}s}"
    x = f"{r['speedup']:5.2f}x" if "speedup" in r else "     -"
    roof = f"{100 * r['roof']:3.0f}%" if r.get("roof") is not None else "   -"
    return f"{r['ms']:8.3f} {r['tokens_per_s']:7.0f} {x} {roof}"


def peak_cell(cells: list[dict | None]) -> str:
    """The peak column (the MoE report's too): the largest peak among a variant's rows (None: not
    run) in MiB, with its ratio to the baseline's same call."""
    peaks = [c for c in cells if c and c.get("peak_bytes") is not None]
    peak = max(peaks, key=lambda c: c["peak_bytes"], default=None)
    if peak is None:
        return f" {'-':>15s}"
    pr = f"{peak['peak_ratio']:5.2f}x" if "peak_ratio" in peak else "      "
    return f" {peak['peak_bytes'] / 2**20:8.1f} {pr}"


def compile_note(cells: list[dict | None]) -> str:
    """torch.compile's own account of a variant's rows: graph breaks, CUDA graphs not used ("" when
    no row reports them)."""
    ran = [c for c in cells if c and "graph_breaks" in c]
    if not ran:
        return ""
    return (f"  {sum(c['graph_breaks'] for c in ran)} graph breaks, "
            f"{sum(c.get('cudagraph_skips', 0) for c in ran)} cudagraph skips")


def table(rows: list[dict]) -> str:
    """One line per (variant, mode): ms, tokens/s, speed-up over the baseline and (decode) the
    fraction of the copy bandwidth the step's bytes move at, per phase; weights and peak in MiB
    with their ratios to the baseline; the logits' relative error.
    Rows that did not run are listed under the table with the reason, then the kernel classes each
    lowbit variant's layers took."""
    cols = columns(rows)
    by = {(r["variant"], r["mode"], r["phase"], r["batch"]): r for r in rows}
    T = next((r["tokens"] for r in rows if r["phase"] == "prefill"), "")
    vw = max([18] + [len(r["variant"]) for r in rows])   # the variant column fits the longest name
    head1 = f"{'variant':{vw}s} {'mode':8s} " + " ".join(
        f"{f'prefill T={T}' if p == 'prefill' else f'decode b{b}':>{W}s}" for p, b in cols)
    head1 += f" {'weights MiB':>15s} {'peak MiB':>15s} {'logits':>9s}"
    head2 = f"{'':{vw + 9}s}" + " ".join(f"{'ms':>8s} {'tok/s':>7s} {'vs base':>6s} {'roof':>4s}" for _ in cols)
    head2 += f" {'':>15s} {'':>15s} {'rel err':>9s}"
    lines = [head1, head2]
    notes, kernels = [], {}
    for variant, mode in dict.fromkeys((r["variant"], r["mode"]) for r in rows):
        cells = [by.get((variant, mode, p, b)) for p, b in cols]
        line = f"{variant:{vw}s} {mode:8s} " + " ".join(_cell(c) for c in cells)
        any_r = next((c for c in cells if c), {})
        w = any_r.get("weight_bytes")
        wr = f"{any_r['weights_ratio']:5.2f}x" if "weights_ratio" in any_r else "      "
        line += f" {w / 2**20:8.1f} {wr}" if w is not None else f" {'-':>15s}"
        line += peak_cell(cells)
        err = any_r.get("logits_rel_err")
        line += f" {err:9.2e}" if err is not None else f" {'-':>9s}"
        if mode != "eager":
            line += compile_note(cells)
        lines.append(line)
        if any_r.get("kernels"):
            kernels[variant] = ", ".join(f"{k} x{n}" for k, n in any_r["kernels"].items())
        for c in cells:
            why = c and c.get("ms") is None and (c.get("error") or c.get("skipped"))
            if why:   # a variant that cannot run here ("n/a: ...") gets one line, not one per row
                notes.append(f"  {f'{variant} {mode}' if why.startswith('n/a') else c['name']}: {why}")
    lines.append("(vs base = baseline ms / ms in the same mode, phase and batch: > 1 is faster; roof = the decode "
                 "step's weight + KV-cache bytes per second over the measured copy bandwidth; peak is the largest of "
                 "the variant's calls, its ratio against the baseline's same call)")
    if notes:
        # one line per distinct reason and variant, not one per row
        lines += ["not measured:"] + list(dict.fromkeys(notes))
    if kernels:
        lines += ["kernel classes (layers per class):"] + [f"  {v}: {k}" for v, k in kernels.items()]
    return "\n".join(lines)


def targets(rows: list[dict], shape: str, layers: int) -> str:
    """The short table printed last: every target (lowbit.bench.model_targets) with what the run
    measured, met / MISSED / not run; a count line first."""
    if (shape, layers) != MUST_SHAPE:
        return (f"# targets: none for --shape {shape} --layers {layers} (they are set for "
                f"--shape {MUST_SHAPE[0]} --layers {MUST_SHAPE[1]})")
    lines, met, missed, absent = [], 0, 0, 0
    for r in rows:
        if "must" in r:
            got = "not run" if r["met"] is None else f"{r['speedup']:5.2f}x"
            verdict = "not run" if r["met"] is None else ("met" if r["met"] else "MISSED")
            lines.append(f"  {r['name']:40s} {got:>8s}  must >= {r['must']:.2f}x  {verdict}")
            met, missed, absent = met + (r["met"] is True), missed + (r["met"] is False), absent + (r["met"] is None)
    seen = set()
    for r in rows:
        if "weights_must" in r and r["variant"] not in seen:
            seen.add(r["variant"])
            got = "not run" if r["weights_met"] is None else f"{r['weights_ratio']:5.2f}x"
            verdict = "not run" if r["weights_met"] is None else ("met" if r["weights_met"] else "MISSED")
            lines.append(f"  {r['variant'] + ' weights':40s} {got:>8s}  must <= {r['weights_must']:.2f}x  {verdict}")
            met += r["weights_met"] is True
            missed += r["weights_met"] is False
            absent += r["weights_met"] is None
    head = f"# targets (ratios vs the baseline, same mode): {met} met, {missed} missed, {absent} not run"
    return "\n".join([head] + lines)


def plot(rows: list[dict], path: str) -> None:
    """PNG: per phase, each variant's speed-up over the baseline, eager and compiled (log
    scale, 1 = as fast as the baseline); last panel, weights and peak memory over the baseline's."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    first = {v: next((r for r in rows if r["variant"] == v and r.get("weights_ratio")), {}) for v in variants}
    peak = {v: max((r.get("peak_ratio", 0.0) for r in rows if r["variant"] == v), default=0.0) for v in variants}
    plot_panels(rows, path, key="speedup", ylabel="baseline ms / ms  (>1: faster than the baseline)",
                memory=[("weights", [first[v].get("weights_ratio", float("nan")) for v in variants]),
                        ("peak (largest ratio of a call)", [peak[v] or float("nan") for v in variants])],
                memory_title="GPU memory / baseline's", suptitle="")


def plot_panels(rows: list[dict], path: str, *, key: str, ylabel: str, memory: list[tuple[str, list[float]]],
                memory_title: str, suptitle: str, panel_note: str = "", speed_target=None,
                memory_target=None) -> None:
    """The PNG of `lowbit bench model` runs, dense (plot) and MoE (lowbit.bench.moe_report.plot).
    One panel per (phase, batch): each variant's rows[key] per mode as bars on a log axis (1: as fast
    as the baseline); a last panel with the two `memory` series (label, one value per variant).
    speed_target(phase, batch, variant) and memory_target(variant): a red line over the variant's bars
    where they return a target (None: no line). The figure's title is the shape, then `suptitle`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (ax.yaxis formatters)

    cols = columns(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["variant"], r["mode"], r["phase"], r["batch"]): r for r in rows}
    fig, axes = plt.subplots(1, len(cols) + 1, figsize=(5 * (len(cols) + 1), 5.5))
    x = range(len(variants))
    width = 0.8 / max(len(modes), 1)

    def bars(ax, at, vals, w, label):
        b = ax.bar(at, vals, w, label=label)
        ax.bar_label(b, [f"{v:.2f}" if v == v else "" for v in vals], fontsize=6, rotation=90, padding=2)

    def targets(ax, target_of) -> list[float]:
        drawn = []
        for j, v in enumerate(variants):
            t = target_of(v) if target_of else None
            if t:
                ax.plot([j - 0.45, j + 0.45], [t, t], color="r", lw=1.2)
                drawn.append(t)
        return drawn

    def finish(ax, title):
        ax.set_title(title, fontsize=10)
        ax.set_xticks(list(x), variants, rotation=60, ha="right", fontsize=8)
        ax.legend(fontsize=8)

    for ax, (phase, batch) in zip(axes, cols):
        seen = [1.0]
        for i, mode in enumerate(modes):
            vals = [by.get((v, mode, phase, batch), {}).get(key, float("nan")) for v in variants]
            bars(ax, [j + (i - (len(modes) - 1) / 2) * width for j in x], vals, width, mode)
            seen += [v for v in vals if v == v]
        seen += targets(ax, speed_target and (lambda v, p=phase, b=batch: speed_target(p, b, v)))
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        lo, hi = min(seen) / 1.5, max(seen) * 1.6
        ax.set_ylim(lo, hi)
        ticks = [t for t in TICKS if lo <= t <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel(ylabel)
        finish(ax, f"{phase}" + (f" batch {batch}" if phase == "decode" else "") + panel_note)
    ax = axes[-1]
    for dx, (label, vals) in zip((-0.2, 0.2), memory):
        bars(ax, [j + dx for j in x], vals, 0.4, label)
    targets(ax, memory_target)
    ax.axhline(1.0, color="k", lw=0.8)
    finish(ax, memory_title)
    shape = rows[0]["shape"].split(" T=")[0].split(" B=")[0] if rows else ""
    fig.suptitle(f"lowbit bench model: {shape}{suptitle}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, module: str = "lowbit.bench.model_report", table=table, plot=plot,
         prepare=None) -> int:
    """`python -m MODULE RUN.json [OUT.png]`: the table of a saved run and, given a path, its PNG;
    prepare(rows) first (the MoE report adds its ratios). lowbit.bench.moe_report's main too."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(f"usage: python -m {module} RUN.json [OUT.png]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = json.load(f)["rows"]
    if prepare is not None:
        prepare(rows)
    print(table(rows))
    if len(argv) > 1:
        plot(rows, argv[1])
        print(f"# wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
