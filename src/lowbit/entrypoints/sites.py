"""`lowbit sites`: per-site SQNR diagnosis of a model under a recipe (which site hurts most):
every Linear's input-activation, weight and output SQNR, worst first, with
the suggested action, and a PNG of SQNR by layer and site (before/after SmoothQuant with
--smoothquant). A mixture-of-experts model also gets the routing report
(lowbit.diagnosis.routing_report: top-k flips per MoE layer with the router in high precision and
quantized, expert load, per-expert SQNR) against a round-to-nearest copy under the recipe, and
its PNG beside --png (<stem>_routing.png)."""
from __future__ import annotations

from pathlib import Path


def register(p) -> None:
    from lowbit.recipes.presets import RECIPES
    p.add_argument("--model", default="smollm2", help="smollm2 (embedded), minilm (embedded encoder) or a model directory")
    p.add_argument("--recipe", default="w8a8-int8", help=f"one of: {', '.join(RECIPES)}")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of (calibration-split) Wikipedia text to run")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--top", type=int, default=15, help="how many of the worst sites to print")
    p.add_argument("--smoothquant", nargs="?", type=float, const=0.5, default=None, metavar="ALPHA",
                   help="also report the sites after folding SmoothQuant factors (alpha, default 0.5)")
    p.add_argument("--png", default="lowbit_sites.png", help="where to write the plot")
    p.add_argument("--markdown", default=None, help="also write the table of worst sites as markdown here")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args) -> int:
    """Bad input raises ValueError / FileNotFoundError; lowbit.entrypoints.main prints it without a traceback."""
    import torch
    from lowbit.entrypoints import quantize_args as A
    from lowbit.entrypoints.quantize_args import probe_writable_file
    from lowbit.evaluation.workload import load_model, prepare_texts
    from lowbit.diagnosis.report import optional_png
    from lowbit.diagnosis.sites import plot_sites, site_report
    from lowbit.algorithms.smoothquant import smooth_model
    from lowbit.diagnosis.routing_report import moe_routing
    from lowbit.archs.experts import find_experts
    from lowbit.entrypoints.quantize import experts_refusal
    from lowbit.pipelines.moe import plan_experts
    from lowbit.workflows.job import parse_recipe

    A.recipe_names(args.recipe)            # every check that needs no model comes first
    if "," in args.recipe:
        raise ValueError(f"--recipe {args.recipe!r}: lowbit sites takes one recipe")
    A.text_sizes(args.tokens, args.window)
    A.positive(args.top, "--top")
    A.positive(args.threads, "--threads", allow_none=True)
    if args.smoothquant is not None:
        A.fraction(args.smoothquant, "--smoothquant ALPHA")
    A.png_path(args.png)
    if args.markdown:
        probe_writable_file(args.markdown, "--markdown")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    routing_why = None          # why the MoE routing report cannot be made under this recipe
    if find_experts(loaded.model):
        if args.smoothquant is not None:    # before any site is measured
            raise ValueError("--smoothquant: lowbit sites folds SmoothQuant into the norms, and a MoE model's experts "
                             "share their norm with the router (no exact fold point); drop --smoothquant (lowbit "
                             "quantize --smoothquant folds it into each expert's down side)")
        _, decisions = plan_experts(loaded.model, parse_recipe(args.recipe), [], {})
        routing_why = experts_refusal(args.recipe, decisions, ignore_hint=False)
    texts = prepare_texts(loaded, args.window, args.tokens, args.window)
    reports = [site_report(loaded.model, texts.calib, args.recipe, progress=True)]
    labels = [args.recipe]
    if args.smoothquant is not None:
        smooth_model(loaded.model, texts.calib, alpha=args.smoothquant, progress=True)
        reports.append(site_report(loaded.model, texts.calib, args.recipe, progress=True))
        labels.append(f"{args.recipe} + SmoothQuant (alpha {args.smoothquant})")
    for rep, lab in zip(reports, labels):
        print(f"== {lab}")
        print(f"{len(rep.rows)} sites, {rep.tokens} tokens; worst {args.top}:")
        print(rep.to_markdown(args.top))
    png = optional_png(plot_sites, reports, args.png, labels)
    if png:
        print(f"plot: {png}")
    sections = [(lab, rep.to_markdown(args.top)) for rep, lab in zip(reports, labels)]
    routing = None
    if routing_why is not None:
        print(f"== MoE routing, {args.recipe}: not reported: {routing_why}")
        sections.append((f"MoE routing, {args.recipe}", f"Not reported: {routing_why}"))
    else:
        routing = moe_routing(loaded.model, args.recipe, texts.calib, routing_png(args.png))
    if routing is not None:
        print(f"== MoE routing, {args.recipe} (round to nearest) against the float model")
        print(routing[0])
        sections.append((f"MoE routing, {args.recipe}", routing[0]))
        if routing[1]:
            print(f"routing plot: {routing[1]}")
    if args.markdown:
        Path(args.markdown).write_text("\n\n".join(f"## {lab}\n\n{md}" for lab, md in sections) + "\n")
        print(f"markdown: {args.markdown}")
    return 0


def routing_png(png: str) -> str:
    """Where the routing plot goes: beside the sites plot, <stem>_routing.png."""
    p = Path(png)
    return str(p.with_name(p.stem + "_routing.png"))

