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

import sys

from lowbit.bench import model_report
from lowbit.formats import get_format
from lowbit.recipes.presets import RECIPES

SPEED = {("decode", "W4A16"): 2.0, ("decode", "W8A8"): 1.3, ("prefill", "W8A8"): 1.2}
MEMORY = {4: 0.30, 8: 0.55}
DECODE_BATCHES = range(1, 17)


def recipe_class(name: str) -> tuple[str | None, int | None]:
    """(class, weight bits) of a lowbit recipe: class W4A16 (4-bit weights, no activation
    quantization), W8A8 (8-bit weights and activations) or None (no speed target)."""
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
def _paths(counts: dict) -> str:
    """'dequant:w4a16 x2' (several paths: joined by ', ')."""
    return ", ".join(f"{p} x{n}" for p, n in counts.items())


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
    cols = model_report.columns(rows)
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
        line += model_report.peak_cell(cells)
        err = any_r.get("logits_rel_err")
        line += f" {err:8.1e}" if err is not None else f" {'-':>8s}"
        line += model_report.compile_note(cells)
        lines.append(line)
        if any_r.get("paths") and mode == "eager":
            paths.append(f"  {variant}: {any_r['paths']}")
        if any(c and c.get("expert_paths") for c in cells) and mode == "eager":
            held = max((c.get("scratch_bytes") or 0 for c in cells if c), default=0)
            paths.append(f"  {variant} experts: " + " | ".join(
                f"{'prefill' if p == 'prefill' else f'decode b{b}'} {_paths(c['expert_paths'])}"
                for (p, b), c in zip(cols, cells) if c and c.get("expert_paths"))
                + (f"; bf16 scratch buffers held {held / 2**20:.1f} MiB (in the peak)" if held else ""))
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
        lines += ["paths run (module last_path counts; experts: the grouped path at each row's sorted rows):"] + paths
    if notes:
        lines += ["not measured:"] + list(dict.fromkeys(notes))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plot
def plot(rows: list[dict], path: str) -> None:
    """PNG: per phase, each variant's speed-up over the grouped bf16 baseline, eager and
    compiled (log scale; the must target drawn where one applies); last panel, expert and
    whole weights over bf16's with the memory targets."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    first = {v: next((r for r in rows if r["variant"] == v and r.get("weights_ratio")), {}) for v in variants}

    def speed_target(phase, batch, variant):    # the must target of this phase, where one applies
        if phase == "prefill" or batch in DECODE_BATCHES:
            return SPEED.get((phase, recipe_class(variant)[0]))
        return None

    model_report.plot_panels(
        rows, path, key="vs_grouped", ylabel="grouped bf16 ms / ms  (>1: faster)", panel_note=" (red: must)",
        memory=[(label, [first[v].get(key, float("nan")) for v in variants])
                for key, label in (("expert_ratio", "expert weights"), ("weights_ratio", "whole model"))],
        memory_title="weights / bf16's (red: must for the experts)",
        suptitle=", against the grouped bf16 baseline", speed_target=speed_target,
        memory_target=lambda v: MEMORY.get(recipe_class(v)[1]))


def main(argv: list[str] | None = None) -> int:
    return model_report.main(argv, "lowbit.bench.moe_report", table, plot, add_moe_ratios)


if __name__ == "__main__":
    sys.exit(main())
