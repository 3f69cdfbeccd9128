"""The quantize-and-evaluate pipeline behind `lowbit quantize` (and the measured table in
docs/perplexity.md): load a model and text, diagnose per-site SQNR, optionally SmoothQuant and
override the worst sites, quantize, evaluate before/after.

Text roles are kept apart: perplexity on the first `tokens` of the Wikipedia file ("eval"),
calibration and the per-site report on articles from the end of the file ("calib"), the
clipping report of static scales on Spanish Wikipedia (text the calibration never saw)."""
from __future__ import annotations

import copy
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.nn.recipes import get_recipe


@dataclass
class Loaded:
    """A model with what evaluating it needs. kind: "causal" (perplexity) or "encoder" (cosine)."""
    name: str
    model: torch.nn.Module
    tokenizer: object
    kind: str


def load_model(spec: str) -> Loaded:
    """spec: "smollm2" (embedded default), "minilm" (embedded encoder), a directory holding a Llama
    .gguf file, or a Hugging Face model directory (config.json + safetensors)."""
    from lowbit.nn import embedded
    if spec == "smollm2":
        m, t = embedded.load_smollm2()
        return Loaded("SmolLM2-135M-Instruct", m, t, "causal")
    if spec == "minilm":
        m, t = embedded.load_minilm()
        return Loaded("all-MiniLM-L6-v2", m, t, "encoder")
    d = Path(spec)
    if not d.is_dir():
        raise FileNotFoundError(f"--model {spec!r}: not 'smollm2', 'minilm' or an existing directory")
    ggufs = sorted(d.glob("*.gguf"))
    if ggufs:
        m, t = embedded.load_gguf_llama(ggufs[0])
        return Loaded(ggufs[0].stem, m, t, "causal")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json and no .gguf file; give a Hugging Face model directory")
    import json
    cfg = json.loads((d / "config.json").read_text())
    if "quantization_config" in cfg:
        raise ValueError(f"--model {d} is already quantized ({cfg['quantization_config'].get('quant_method')}); "
                         "give the float checkpoint")
    embedded._offline()
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    try:
        return Loaded(d.name, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), tok, "causal")
    except ValueError:
        return Loaded(d.name, AutoModel.from_pretrained(d, dtype=torch.float32).eval(), tok, "encoder")


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{platform.node() or 'host'}: {dev}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


@dataclass
class Texts:
    """eval_ids: 1-D ids for perplexity; calib: batches for calibration and the site report;
    new: batches of unseen text (clipping report); sentences: encoder evaluation text."""
    eval_ids: torch.Tensor | None
    calib: list
    new: list
    sentences: list[str] = field(default_factory=list)


def prepare_texts(loaded: Loaded, tokens: int, calib_tokens: int, window: int) -> Texts:
    from lowbit.nn.embedded import wiki_articles, wiki_token_ids, windows
    tok = loaded.tokenizer
    if loaded.kind == "causal":
        ev = wiki_token_ids(tok, tokens, split="eval")
        calib = windows(wiki_token_ids(tok, calib_tokens, split="calib"), window)
        new = windows(wiki_token_ids(tok, window, split="eval", lang="es-es"), window)
        return Texts(ev, calib, new)

    def enc(texts):
        return [dict(tok(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt"))
                for i in range(0, len(texts), 16)]
    arts = wiki_articles()
    n = max(16, tokens // 64)                       # ~64 tokens per sentence-sized extract
    sentences = [a[:400] for a in arts[:n]]
    calib = enc([a[:400] for a in arts[::-1][:max(16, calib_tokens // 64)]])
    new = enc([a[:400] for a in wiki_articles("es-es")[:16]])
    return Texts(None, calib, new, sentences)


def metric(loaded: Loaded, model: torch.nn.Module, reference: torch.nn.Module | None, texts: Texts,
           window: int, progress: bool, desc: str) -> float:
    """Perplexity (causal) or mean embedding cosine against `reference` (encoder)."""
    from lowbit.nn.evaluate import embedding_cosine, perplexity
    if loaded.kind == "causal":
        return perplexity(model, texts.eval_ids, window, progress=progress, desc=desc)
    if reference is None:
        return 1.0
    return float(embedding_cosine(reference, model, loaded.tokenizer, texts.sentences).mean())


@dataclass
class RecipeRun:
    recipe: str
    model: torch.nn.Module
    summary: object
    sites_before: object
    sites_after: object | None
    overrides: dict
    value: float
    clipping: list
    tokens: object = None       # evaluate.TokenMetrics (KL / top-1 vs the reference) when a reference was given
    calib_s: float = 0.0        # seconds from the float copy to the quantized model (rotation, SmoothQuant, AWQ,
    eval_s: float = 0.0         # GPTQ, site reports, quantization); seconds evaluating it
    kl_pick: object = None      # site_kl.KLPick when the overrides were picked by measured KL


def run_recipe(loaded: Loaded, texts: Texts, recipe: str, *, smoothquant: float | None = None,
               override_worst: float = 0.0, override_to: str = "skip", ignore=None, overrides=None,
               static: bool = False, window: int = 512, progress: bool = True, sites: bool = True,
               method: str = "rtn", awq: bool = False, rotate: str | None = None,
               reference: list | torch.nn.Module | None = None, mse: bool = False,
               override_by: str = "block") -> RecipeRun:
    """Quantize a copy of loaded.model by `recipe` and evaluate it. smoothquant: alpha or None;
    override_worst: fraction of Linear layers (<= 0.05 by the issue's rule) whose worst output
    SQNR sends them to `override_to` ("skip" = high precision, or a recipe name).
    method: "rtn" or "gptq" (lowbit.nn.gptq, calibrated on texts.calib); awq: fold AWQ scales
    (lowbit.nn.awq, weight-only recipes) after SmoothQuant and before quantizing; rotate:
    "hadamard" rotates the residual stream first (lowbit.nn.rotation) or None; reference: the float
    model, or evaluate.reference_logits of it on texts.eval_ids (causal models), to report the
    next-token KL divergence and top-1 agreement beside perplexity (RecipeRun.tokens). mse: MSE-optimal
    weight scales (lowbit.nn.scale_search) instead of round to nearest's, for RTN and GPTQ alike.
    override_by: how the override_worst sites are picked: "block" (worst block SQNR in the per-site
    report) or "kl" (largest measured drop of the next-token KL on texts.calib, greedy:
    lowbit.nn.site_kl; causal models), both on round to nearest's codes after the folds."""
    from lowbit.nn.calibration import calibrate_static_scales, clipping_report
    from lowbit.nn.quantize_model import linear_layers, quantize_model
    from lowbit.nn.sites import override_count, pick_overrides, site_report
    from lowbit.nn.smoothquant import smooth_model
    r = get_recipe(recipe)
    if override_by not in ("block", "kl"):
        raise ValueError(f"override_by={override_by!r}: choose 'block' (block SQNR) or 'kl' (measured KL)")
    if override_by == "kl" and loaded.kind != "causal":
        raise ValueError("override_by='kl' measures next-token distributions: it needs a causal language model; "
                         "use override_by='block' for an encoder")
    t0 = time.perf_counter()
    m = copy.deepcopy(loaded.model)
    if rotate is not None:
        if rotate != "hadamard":
            raise ValueError(f"rotate={rotate!r}: the rotation lowbit knows is 'hadamard'")
        from lowbit.nn.rotation import rotate_model
        rotate_model(m)
    # sites=False skips the diagnosis when nothing depends on it (no overrides to pick).
    want = sites or (override_worst > 0 and override_by == "block")
    sites_before = site_report(m, texts.calib, r, ignore=ignore, overrides=overrides, progress=progress) \
        if sites else None
    sites_after = None
    if smoothquant is not None:
        smooth_model(m, texts.calib, alpha=smoothquant, progress=progress)
        if want:
            sites_after = site_report(m, texts.calib, r, ignore=ignore, overrides=overrides, progress=progress)
    elif want and sites_before is None:
        sites_before = site_report(m, texts.calib, r, ignore=ignore, overrides=overrides, progress=progress)
    if awq:
        from lowbit.nn.awq import awq_model
        awq_model(m, r, texts.calib, progress=progress)
    ov = dict(overrides or {})
    picked, klp = {}, None
    if override_worst > 0 and override_by == "kl":
        from lowbit.nn.site_kl import kl_pick
        klp = kl_pick(m, texts.calib, r, override_count(len(linear_layers(m)), override_worst), to=override_to,
                      ignore=ignore, overrides=overrides, progress=progress)
        picked = {s: override_to for s in klp.picked}
        ov.update(picked)
    elif override_worst > 0:
        final = sites_after or sites_before
        picked = pick_overrides(final, len(linear_layers(m)), override_worst, override_to)
        ov.update(picked)
    scales = None
    if static and override_to != "skip" and picked:
        raise ValueError("static scales are calibrated for the recipe's activation format; combine them only "
                         "with override_to='skip'")
    if static:
        if r.act is None:
            raise ValueError(f"--static-scales needs a recipe with activation quantization; {r.name} is weight-only")
        scales = calibrate_static_scales(m, texts.calib, r.act)
    summary = quantize_model(m, r, ignore=ignore, overrides=ov or None, act_static_scales=scales, progress=progress,
                             method=method, calib=texts.calib if method != "rtn" else None, mse=mse)
    clipping = clipping_report(m, texts.new) if static else []
    t1 = time.perf_counter()
    tokens = None
    if reference is not None and loaded.kind == "causal":
        from lowbit.nn.evaluate import token_metrics
        tokens = token_metrics(m, texts.eval_ids, reference, window, progress=progress, desc=f"{r.name} eval")
        value = tokens.perplexity
    else:
        value = metric(loaded, m, loaded.model, texts, window, progress, f"{r.name} eval")
    return RecipeRun(r.name, m, summary, sites_before, sites_after, picked, value, clipping, tokens,
                     t1 - t0, time.perf_counter() - t1, klp)
