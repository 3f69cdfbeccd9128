"""Ratios, targets and reports of the MoE rows of `lowbit bench model` (lowbit.bench.moe_model):
each row against the grouped bf16 baseline and transformers' expert loop, the expert weights
against bf16's, and the must targets met or missed. Needs no GPU:
`python -m lowbit.bench.moe_report RUN.json [PNG]` redraws a run.

Targets (must), judged per row against the grouped bf16 baseline of the same mode, phase and
batch, and per variant for memory (the recipe's bit widths decide which apply):
  decode, batch 1..16   W4A16 (4-bit weights, 16-bit activations)   >= 2.0x grouped bf16
                        W8A8  (8-bit weights and activations)       >= 1.3x
  prefill               W8A8                                        >= 1.2x
  expert weights        4-bit weights <= 0.30x bf16, 8-bit weights <= 0.55x bf16
A row whose target cannot be judged (not measured, no grouped baseline) says n/a, not met.
"""
from __future__ import annotations

import json
import sys

from lowbit.bench.model_report import TICKS

SPEED = {("decode", "W4A16"): 2.0, ("decode", "W8A8"): 1.3, ("prefill", "W8A8"): 1.2}
MEMORY = {4: 0.30, 8: 0.55}
DECODE_BATCHES = range(1, 17)


def recipe_class(name: str) -> tuple[str | None, int | None]:
    """(class, weight bits) of a lowbit recipe: class W4A16 (4-bit weights, no activation
    quantization), W8A8 (8-bit weights and activations) or None (no speed target)."""
    from lowbit.formats import get_format
    from lowbit.recipes.presets import RECIPES

    r = RECIPES.get(name)
    if r is None:
        return None, None
    wb = get_format(r.weight.format).bits
    ab = None if r.act is None else get_format(r.act.format).bits
    cls = "W4A16" if (wb, ab) == (4, None) else "W8A8" if (wb, ab) == (8, 8) else None
    return cls, wb


def add_moe_ratios(rows: list[dict]) -> None:
    """vs_grouped (grouped bf16 ms / ms), vs_loop (loop bf16 ms / ms), expert_ratio (expert
    bytes / the loop baseline's) and the must fields, in place (see the module docstring)."""
    key = lambda r: (r["mode"], r["phase"], r["batch"])  # noqa: E731
    loop = {key(r): r for r in rows if r["kind"] == "baseline"}
    grouped = {key(r): r for r in rows if r["kind"] == "grouped"}
    for r in rows:
        for field, base in (("vs_loop", loop.get(key(r))), ("vs_grouped", grouped.get(key(r)))):
            if base and base.get("ms") and r.get("ms"):
                r[field] = base["ms"] / r["ms"]
            else:
                r.pop(field, None)
        b = loop.get(key(r))
        if b and b.get("expert_bytes") and r.get("expert_bytes"):
            r["expert_ratio"] = r["expert_bytes"] / b["expert_bytes"]
        if r["kind"] == "lowbit":
            _must(r, grouped.get(key(r)))


def _must(r: dict, grouped: dict | None) -> None:
    cls, bits = recipe_class(r["variant"])
    target = SPEED.get((r["phase"], cls)) if r["phase"] == "prefill" or r["batch"] in DECODE_BATCHES else None
    if target is not None:
        r["must_speed"] = f">= {target:.1f}x {grouped['variant'] if grouped else 'grouped bf16'}"
        r["must_speed_met"] = r["vs_grouped"] >= target if "vs_grouped" in r else None
    if bits in MEMORY:
        r["must_memory"] = f"experts <= {MEMORY[bits]:.2f}x bf16"
        r["must_memory_met"] = r["expert_ratio"] <= MEMORY[bits] if "expert_ratio" in r else None


def verdict(met: bool | None) -> str:
    return "n/a" if met is None else "met" if met else "MISSED"


# ------------------------------------------------------------------------------ table
def _columns(rows: list[dict]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r["phase"], r["batch"]) for r in rows))


def _cell(r: dict | None) -> str:
    if r is None:
        return f"{'-':>26s}"
    if r.get("ms") is None:
        why = r.get("skipped") or ""
        return f"{'n/a' if why.startswith('n/a') else 'FAILED' if r.get('error') else 'skipped':>26s}"
    g = f"{r['vs_grouped']:5.2f}x" if "vs_grouped" in r else "     -"
    lp = f"{r['vs_loop']:5.2f}x" if "vs_loop" in r else "     -"
    mark = {True: "+", False: "!", None: " "}[r.get("must_speed_met")] if "must_speed" in r else " "
    return f"{r['ms']:9.3f} {g}{mark} {lp}"


def table(rows: list[dict]) -> str:
    """One line per (variant, mode): ms and the ratios over the grouped bf16 baseline and the
    loop per phase, expert and whole weights with their ratios to bf16, peak; then every
    must target met, missed or n/a, and what did not run."""
    cols = _columns(rows)
    by = {(r["variant"], r["mode"], r["phase"], r["batch"]): r for r in rows}
    T = next((r["tokens"] for r in rows if r["phase"] == "prefill"), "")
    head1 = f"{'variant':14s} {'mode':8s} " + " ".join(
        f"{f'prefill T={T}' if p == 'prefill' else f'decode b{b}':>26s}" for p, b in cols)
    head1 += f" {'experts MiB':>15s} {'weights MiB':>15s} {'peak MiB':>15s} {'logits':>8s}"
    head2 = f"{'':24s}" + " ".join(f"{'ms':>9s} {'vs grp':>7s} {'vs loop':>7s}" for _ in cols)
    head2 += f" {'':>15s} {'':>15s} {'':>15s} {'rel err':>8s}"
    lines, notes, musts, paths = [head1, head2], [], [], []
    for variant, mode in dict.fromkeys((r["variant"], r["mode"]) for r in rows):
        cells = [by.get((variant, mode, p, b)) for p, b in cols]
        any_r = next((c for c in cells if c), {})
        line = f"{variant:14s} {mode:8s} " + " ".join(_cell(c) for c in cells)
        for key, ratio in (("expert_bytes", "expert_ratio"), ("weight_bytes", "weights_ratio")):
            v = any_r.get(key)
            rt = f"{any_r[ratio]:5.2f}x" if ratio in any_r else "      "
            line += f" {v / 2**20:8.1f} {rt}" if v is not None else f" {'-':>15s}"
        peaks = [c for c in cells if c and c.get("peak_bytes") is not None]
        peak = max(peaks, key=lambda c: c["peak_bytes"], default=None)
        pr = f"{peak['peak_ratio']:5.2f}x" if peak and "peak_ratio" in peak else "      "
        line += f" {peak['peak_bytes'] / 2**20:8.1f} {pr}" if peak else f" {'-':>15s}"
        err = any_r.get("logits_rel_err")
        line += f" {err:8.1e}" if err is not None else f" {'-':>8s}"
        ran = [c for c in cells if c and "graph_breaks" in c]
        if ran:   # torch.compile's own account: graph breaks, CUDA graphs not used
            line += (f"  {sum(c['graph_breaks'] for c in ran)} graph breaks, "
                     f"{sum(c.get('cudagraph_skips', 0) for c in ran)} cudagraph skips")
        lines.append(line)
        if any_r.get("paths") and mode == "eager":
            paths.append(f"  {variant}: {any_r['paths']}")
        for c in cells:
            if c and c.get("ms") is None and (c.get("error") or c.get("skipped")):
                notes.append(f"  {c['variant']} {c['mode']}: {c.get('error') or c.get('skipped')}")
            if c and "must_speed" in c:
                got = f"{c['vs_grouped']:.2f}x" if "vs_grouped" in c else "-"
                musts.append(f"  {c['name']:34s} {got:>7s} (must {c['must_speed']}): {verdict(c['must_speed_met'])}")
    for variant in dict.fromkeys(r["variant"] for r in rows):
        r = next((x for x in rows if x["variant"] == variant and "must_memory" in x), None)
        if r is not None:
            got = f"{r['expert_ratio']:.2f}x" if "expert_ratio" in r else "-"
            musts.append(f"  {variant + ' expert weights':34s} {got:>7s} (must {r['must_memory']}): "
                         f"{verdict(r['must_memory_met'])}")
    lines.append("(vs grp / vs loop = the grouped bf16 / loop bf16 baseline's ms over this ms in the same mode, "
                 "phase and batch: > 1 is faster; + met, ! missed a must target; weights and peak against the "
                 "loop bf16 baseline)")
    if musts:
        lines += ["must targets:"] + musts
    if paths:
        lines += ["paths run (module last_path counts):"] + paths
    if notes:
        lines += ["not measured:"] + list(dict.fromkeys(notes))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plot
def plot(rows: list[dict], path: str) -> None:
    """PNG: per phase, each variant's speed-up over the grouped bf16 baseline, eager and
    compiled (log scale; the must target drawn where one applies); last panel, expert and
    whole weights over bf16's with the memory targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cols = _columns(rows)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by = {(r["variant"], r["mode"], r["phase"], r["batch"]): r for r in rows}
    fig, axes = plt.subplots(1, len(cols) + 1, figsize=(5 * (len(cols) + 1), 5.5))
    x = range(len(variants))
    width = 0.8 / max(len(modes), 1)
    for ax, (phase, batch) in zip(axes, cols):
        seen = [1.0]
        for i, mode in enumerate(modes):
            vals = [by.get((v, mode, phase, batch), {}).get("vs_grouped", float("nan")) for v in variants]
            bars = ax.bar([j + (i - (len(modes) - 1) / 2) * width for j in x], vals, width, label=mode)
            ax.bar_label(bars, [f"{v:.2f}" if v == v else "" for v in vals], fontsize=6, rotation=90, padding=2)
            seen += [v for v in vals if v == v]
        for j, v in enumerate(variants):   # the must target of this phase, where one applies
            t = SPEED.get((phase, recipe_class(v)[0])) if phase == "prefill" or batch in DECODE_BATCHES else None
            if t:
                ax.plot([j - 0.45, j + 0.45], [t, t], color="r", lw=1.2)
                seen.append(t)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        lo, hi = min(seen) / 1.5, max(seen) * 1.6
        ax.set_ylim(lo, hi)
        ticks = [t for t in TICKS if lo <= t <= hi]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{phase}" + (f" batch {batch}" if phase == "decode" else "") + " (red: must)", fontsize=10)
        ax.set_ylabel("grouped bf16 ms / ms  (>1: faster)")
        ax.set_xticks(list(x), variants, rotation=60, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax = axes[-1]
    first = {v: next((r for r in rows if r["variant"] == v and r.get("weights_ratio")), {}) for v in variants}
    for dx, key, label in ((-0.2, "expert_ratio", "expert weights"), (0.2, "weights_ratio", "whole model")):
        vals = [first[v].get(key, float("nan")) for v in variants]
        bars = ax.bar([j + dx for j in x], vals, 0.4, label=label)
        ax.bar_label(bars, [f"{v:.2f}" if v == v else "" for v in vals], fontsize=6, rotation=90, padding=2)
    for j, v in enumerate(variants):
        t = MEMORY.get(recipe_class(v)[1])
        if t:
            ax.plot([j - 0.45, j + 0.45], [t, t], color="r", lw=1.2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_title("weights / bf16's (red: must for the experts)", fontsize=10)
    ax.set_xticks(list(x), variants, rotation=60, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    shape = rows[0]["shape"].split(" T=")[0].split(" B=")[0] if rows else ""
    fig.suptitle(f"lowbit bench model: {shape}, against the grouped bf16 baseline", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m lowbit.bench.moe_report RUN.json [OUT.png]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = json.load(f)["rows"]
    add_moe_ratios(rows)
    print(table(rows))
    if len(argv) > 1:
        plot(rows, argv[1])
        print(f"# wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
