"""The report `lowbit quantize` writes: a markdown file and PNG figures (per-site SQNR by layer,
metric before/after). Written to a temporary name and renamed, so a report is never half-written."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class QuantizeResult:
    """What one `lowbit quantize` run measured. metric: "perplexity" (lower is better) or
    "embedding cosine" (higher is better); before/after: the metric of the float and quantized
    model; bytes: stored weight bytes (bf16 baseline) before/after; tokens_per_s: CUDA only;
    tokens: evaluate.TokenMetrics of the quantized model against the float one (causal models)."""
    model: str
    recipe: str
    metric: str
    before: float
    after: float
    bytes_before: int
    bytes_after: int
    eval_tokens: int
    command: str
    machine: str
    smoothquant: str | None = None
    summary: str = ""
    overrides: dict = field(default_factory=dict)
    sites_markdown: list[tuple[str, str]] = field(default_factory=list)
    clipping: list[dict] = field(default_factory=list)
    tokens_per_s: tuple[float, float] | None = None
    checkpoint: str | None = None
    extra: list[str] = field(default_factory=list)
    tokens: object = None

    def change(self) -> str:
        if self.metric == "perplexity":
            return f"{100 * (self.after / self.before - 1):+.2f}%"
        return f"{self.after - self.before:+.4f}"


def _atomic_write(path: Path, data: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data, encoding="utf-8")
    os.replace(tmp, path)


def optional_png(plot, *args, **kwargs) -> str | None:
    """plot(*args, **kwargs) -> path of a PNG; when matplotlib is missing, None and a one-line
    note instead: a report's picture must never cost the user the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"note: matplotlib is not installed, so {plot.__name__} wrote no PNG "
              "(pip install matplotlib, or the [models] extra)", flush=True)
        return None
    return str(plot(*args, **kwargs))


def plot_metric(result: QuantizeResult, path: Path) -> Path:
    """Bar chart of the metric before/after quantization."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = ["float", result.recipe + (" + SQ" if result.smoothquant else "")]
    bars = ax.bar(labels, [result.before, result.after], color=["#777777", "#2a7ab0"])
    for b, v in zip(bars, [result.before, result.after]):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.4g}", ha="center", va="bottom")
    ax.set_ylabel(result.metric)
    ax.set_title(f"{result.model}: {result.metric} ({result.change()})")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_report(result: QuantizeResult, out_dir: str | os.PathLike, sites_png: str | None = None) -> Path:
    """Write lowbit_report.md (and lowbit_metric.png when matplotlib is installed) into out_dir;
    returns the markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metric_png = optional_png(plot_metric, result, out / "lowbit_metric.png")
    mb = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    lines = [f"# lowbit quantize: {result.model}, recipe {result.recipe}", "",
             f"Command: `{result.command}`  ", f"Machine: {result.machine}", "",
             "| | float | quantized | change |", "|---|---:|---:|---:|",
             f"| {result.metric} ({result.eval_tokens} tokens) | {result.before:.4f} | {result.after:.4f} | {result.change()} |",
             f"| weight bytes (bf16 baseline) | {mb(result.bytes_before)} | {mb(result.bytes_after)} | "
             f"x{result.bytes_before / max(result.bytes_after, 1):.2f} smaller |"]
    if result.tokens is not None:
        t = result.tokens
        lines += [f"| mean next-token KL from float, nats (max {t.kl_max:.3f}) | 0 | {t.kl:.4f} | |",
                  f"| top-1 agreement with float | 100% | {100 * t.top1:.2f}% | |"]
    if result.tokens_per_s:
        a, b = result.tokens_per_s
        lines.append(f"| tokens/s (CUDA prefill) | {a:.0f} | {b:.0f} | x{b / a:.2f} |")
    lines += ["", f"![metric]({Path(metric_png).name})" if metric_png else "(no figures: matplotlib is not installed)",
              ""]
    if result.smoothquant:
        lines += [f"SmoothQuant: {result.smoothquant}", ""]
    if result.overrides:
        lines += ["Per-site overrides (worst sites of the report): " +
                  ", ".join(f"`{k}` -> {v}" for k, v in result.overrides.items()), ""]
    lines += ["## What was quantized", "", "```", result.summary, "```", ""]
    for title, md in result.sites_markdown:
        lines += [f"## {title}", "", md, ""]
    if sites_png:
        lines += [f"![per-site SQNR]({Path(sites_png).name})", ""]
    if result.clipping:
        lines += ["## Static activation scales: clipping on new text", "",
                  "| layer | clipped fraction | max abs(x)/range |", "|---|---:|---:|"]
        lines += [f"| {r['name']} | {r['clip_rate']:.2e} | {r['max_ratio']:.2f} |" for r in result.clipping[:15]]
        lines.append("")
    if result.checkpoint:
        lines += [f"Checkpoint: `{result.checkpoint}`", ""]
    lines += result.extra
    md = out / "lowbit_report.md"
    _atomic_write(md, "\n".join(lines) + "\n")
    return md
