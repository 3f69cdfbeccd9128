"""QuantizeSession: the whole of `lowbit quantize` as a library: load a model, round its float parts to
the dtype the checkpoint stores, prepare the calibration and evaluation text, measure the float model
once, then for each job quantize a copy (lowbit.workflows.quantize.quantize_job), report what it cost
(sites, KV cache, LM head, MoE routing) and write the checkpoint and the report.

    import lowbit as lb

    s = lb.QuantizeSession.load("smollm2")
    s.prepare(lb.TextOptions(tokens=8192, calib_tokens=1024))
    job = lb.QuantizeJob.build("w8a8-int8", lb.best_steps("w8a8-int8").steps)
    res = s.quantize(job)
    s.write(res, "w8a8-int8-out")
    print(res.line())

`lowbit quantize` parses its flags, runs the checks that need no model, and calls these four steps;
what it prints is what the session says (`say`: printed by default). Under torchrun every rank
calibrates on its share of the batches and evaluates; rank 0 alone writes.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lowbit.algorithms import distributed as D
from lowbit.archs.experts import find_experts
from lowbit.diagnosis.attention_sites import attention_site_report
from lowbit.diagnosis.report import QuantizeResult, optional_png, write_report
from lowbit.diagnosis.routing_report import plot_routing, routing_report
from lowbit.diagnosis.sites import plot_sites
from lowbit.evaluation.evaluate import float_reference, model_bytes, tokens_per_second
from lowbit.evaluation import workload
from lowbit.evaluation.workload import (CALIB_TOKENS, EVAL_TOKENS, Loaded, Texts, TextSources, machine, metric,
                                       save_float)
from lowbit.io.outdir import staged
from lowbit.nn.experts import QuantExperts
from lowbit.pipelines.checkpoint import save_compressed
from lowbit.progress import say_flushed
from lowbit.recipes.plan import linear_layers
from lowbit.workflows.job import QuantizeJob
from lowbit.workflows.quantize import JobRun, checkpoint_bytes, quantize_job, round_float_parts
from lowbit.workflows.steps import SmoothQuant



@dataclass(frozen=True)
class TextOptions(TextSources):
    """The text a session calibrates and evaluates on: `tokens` evaluation and `calib_tokens`
    calibration tokens, read in windows of `window`, from the sources of TextSources (the embedded
    Wikipedia articles, or calib_data / eval_data files; text_column, chat, fit). Its `evaluate` is
    the session's: QuantizeSession.prepare(evaluate=...) sets it."""
    tokens: int = EVAL_TOKENS
    calib_tokens: int = CALIB_TOKENS
    window: int = 512

    def prepare(self, loaded: Loaded, evaluate: bool, calib_tokens: int | None = None) -> Texts:
        """The texts for `loaded` (calib_tokens: another calibration count than the options')."""
        return workload.prepare_texts(loaded, self.tokens, self.calib_tokens if calib_tokens is None else calib_tokens,
                                      self.window, options=self, evaluate=evaluate)


def _kl_top1(t) -> str:
    """The token metrics' agreement with the float model, as every report line writes them."""
    # significant digits, not decimals: a tiny model's KL of 3e-5 nats is not "0.0000"
    return f"KL from float {t.kl:.3g} nats, top-1 agreement {100 * t.top1:.2f}%"


def _metrics(mname: str, v) -> str:
    """A metric value (a float) or token metrics (perplexity, KL, top-1) for a report line."""
    return f"{mname} {v.perplexity:.4f}, {_kl_top1(v)}" if hasattr(v, "kl") else f"{mname} {v:.4f}"


def compare_line(what: str, other: str, mname: str, run: JobRun, without) -> str:
    """One report line: the run's metrics (token metrics where measured) and `without` (the same
    model with one part put back in high precision), with that part's own cost."""
    with_ = run.tokens if run.tokens is not None else run.value
    line = f"{what}: {_metrics(mname, with_)}; {other}: {_metrics(mname, without)}"
    if hasattr(with_, "perplexity") and hasattr(without, "perplexity"):
        line += f"; the part's own cost: {with_.perplexity / without.perplexity - 1:+.2%} perplexity"
    return line


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB"


@dataclass
class RecipeResult:
    """One job's outcome in a session: the run (the quantized model and its metrics), the report
    it writes, and the site and routing reports behind the report's sections and plots."""
    job: QuantizeJob
    run: JobRun
    report: QuantizeResult
    sites: list = field(default_factory=list)          # [(site report, label)]: before / after SmoothQuant
    routing: object = None                             # routing_report.RoutingReport (MoE) or None
    saved: bool = False                                # the checkpoint was written (write(..., save=True))
    out: Path | None = None
    dtype_name: str = "float32"                        # the float parts' dtype (the session's)

    def line(self) -> str:
        """The closing line: the metric before -> after, KL / top-1, the bytes and the report's path."""
        r = self.report
        size = (f"bytes {_mib(r.bytes_before)} ({self.dtype_name} float) -> {_mib(r.bytes_after)} "
                f"({'on disk' if self.saved else 'estimated'})")
        md = (self.out or Path(".")) / "lowbit_report.md"
        if r.after is None:
            return f"{r.recipe}: not evaluated (--no-eval), {size}; report {md}"
        kl = "" if self.run.tokens is None else f", {_kl_top1(self.run.tokens)}"
        return f"{r.recipe}: {r.metric} {r.before:.4f} -> {r.after:.4f} ({r.change()}){kl}, {size}; report {md}"


class QuantizeSession:
    """One loaded model quantized by one or more jobs (see the module docstring). Build it with
    load(); prepare() once; then quantize() and write() per job."""

    def __init__(self, loaded: Loaded, *, command: str = "", say: Callable[[str], None] = say_flushed):
        self.loaded = loaded
        self.command = command
        self.say = say
        self.moe = bool(find_experts(loaded.model))
        self.n_linear = len(linear_layers(loaded.model))
        self.t0 = time.time()

    @classmethod
    def load(cls, model: str, *, command: str = "", say: Callable[[str], None] = say_flushed) -> "QuantizeSession":
        """Load `model` (lowbit.evaluation.workload.load_model: "smollm2", "minilm", a directory or a
        cached ORG/NAME). command: the command line the report records."""
        t0 = time.time()
        say(f"loading {model} ...")
        # looked up at call time: a test (or a caller) may stand in its own loader
        s = cls(workload.load_model(model), command=command, say=say)
        s.t0 = t0
        return s

    @property
    def causal(self) -> bool:
        return self.loaded.kind == "causal"

    def prepare(self, text: TextOptions = TextOptions(), *, dtype: str | torch.dtype = "auto", evaluate: bool = True,
                save_float_to: str | Path | None = None, overwrite: bool = False) -> None:
        """Round the float parts to `dtype` ("auto": what the source stores; the model evaluated is then
        the one the checkpoint holds), write the float baseline to save_float_to when given, prepare
        the text and, when evaluating, measure the float model once (its metric, and the reference
        every job's KL / top-1 is measured against)."""
        loaded, say = self.loaded, self.say
        self.text, self.evaluate = text, evaluate
        self.dtype = (loaded.dtype or torch.float32) if dtype == "auto" else \
            getattr(torch, dtype) if isinstance(dtype, str) else dtype
        round_float_parts(loaded.model, self.dtype)
        self.dtype_name = str(self.dtype).replace("torch.", "")
        self.rounded = f"; float parts rounded to {self.dtype_name}, as the checkpoint stores them" \
            if self.dtype != torch.float32 else ""
        say(f"float baseline: {loaded.origin or loaded.name}{self.rounded}")
        if save_float_to and D.rank() == 0:
            save_float(loaded, save_float_to, overwrite=overwrite)
            say(f"float baseline written to {save_float_to} (float32, transformers' layout, with its tokenizer)")
        self.texts = text.prepare(loaded, evaluate)
        for line in self.texts.notes:
            say(line)
        self.texts.calib = D.shard(self.texts.calib)          # all batches in one process
        self.before, self.reference = None, None
        if evaluate and self.causal:      # one float pass: its perplexity and every job's reference
            self.before, self.reference = float_reference(loaded.model, self.texts.eval_ids, text.window, True,
                                                          "float eval")
        elif evaluate:
            self.before = metric(loaded, loaded.model, None, self.texts, text.window, True, "float eval")
        self.metric = "perplexity" if self.causal else "embedding cosine"
        self.eval_count = (self.texts.eval_ids.numel() if self.texts.eval_ids is not None else text.tokens) \
            if self.causal else len(self.texts.sentences)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.bytes_before = model_bytes(loaded.model, self.itemsize)
        self.tps_before = tokens_per_second(loaded.model, self.texts.eval_ids) \
            if self.texts.eval_ids is not None and evaluate else None
        if evaluate:
            unit = "tokens" if self.causal else "sentences"
            say(f"{loaded.name}: float {self.metric} {self.before:.4f} on {self.eval_count} {unit} "
                f"({time.time() - self.t0:.0f} s)")

    def calib_texts(self, calib_tokens: int | None) -> Texts:
        """The session's texts, with calib_tokens calibration tokens when that is another count
        (re-read, the calibration data's lines said again)."""
        if calib_tokens is None or calib_tokens == self.text.calib_tokens:
            return self.texts
        texts = self.text.prepare(self.loaded, self.evaluate, calib_tokens)
        for line in texts.notes:
            if line.startswith("--calib-data"):
                self.say(line)
        return dataclasses.replace(self.texts, calib=D.shard(texts.calib))

    def quantize(self, job: QuantizeJob, *, calib_tokens: int | None = None, sites: bool = True,
                 estimated: bool = False) -> RecipeResult:
        """Quantize a copy of the model by `job` on calib_tokens calibration tokens (None: the text
        options'), evaluate it when the session evaluates, and assemble its report. sites: the per-site
        report of round to nearest's codes. estimated: the bytes are estimated (nothing will be saved)."""
        say, loaded = self.say, self.loaded
        recipe = job.recipe.name
        texts = self.calib_texts(calib_tokens)
        run = quantize_job(loaded, texts, job, window=self.text.window, evaluate=self.evaluate, sites=sites,
                           reference=self.reference)
        reps = [r for r in (run.sites_before, run.sites_after) if r is not None]
        labels = ([recipe] if run.sites_before is not None else []) + \
            ([f"{recipe} + SmoothQuant"] if run.sites_after is not None else [])
        for r, label in zip(reps, labels):
            say(("" if label == recipe else "after SmoothQuant:\n") + str(r))
        if run.overrides:
            say("overridden worst sites: " + ", ".join(f"{k} -> {v}" for k, v in run.overrides.items()))
        say(str(run.summary))
        tps = tokens_per_second(run.model, self.texts.eval_ids) if self.tps_before else None
        sq = job.step(SmoothQuant)
        res = QuantizeResult(
            model=loaded.name, recipe=recipe, metric=self.metric, before=self.before, after=run.value,
            bytes_before=self.bytes_before, bytes_after=model_bytes(run.model, self.itemsize),
            eval_tokens=self.eval_count, command=self.command, machine=machine(),
            smoothquant=None if sq is None else f"alpha {sq.alpha}",
            summary=str(run.summary), overrides=run.overrides, clipping=run.clipping, tokens=run.tokens,
            tokens_per_s=(self.tps_before, tps) if tps else None,
            bytes_label=f"weight bytes (float parts in {self.dtype_name}; quantized: "
                        f"{'estimated, not saved' if estimated else 'the checkpoint on disk'})",
            baseline=(loaded.origin or loaded.name) + self.rounded,
            sites_markdown=[("Worst sites" + (" before SmoothQuant" if label == recipe and len(reps) > 1 else
                                              "" if label == recipe else " after SmoothQuant"), r.to_markdown(10))
                            for r, label in zip(reps, labels)])
        if run.float_head is not None:
            res.extra.append(compare_line(f"LM head {job.lm_head_kind} (weight-only)",
                                          "with the LM head in high precision", self.metric, run, run.float_head))
            say(res.extra[-1])
        if run.without_kv is not None:
            res.extra.append(compare_line(f"KV cache {job.kv_cache.name}", "with the KV cache unquantized",
                                          self.metric, run, run.without_kv))
            say(res.extra[-1])
            att = attention_site_report(run.model, self.texts.calib[0], run.summary.kv_cache)
            say(str(att))
            res.sites_markdown.append(("Attention sites (KV cache; first calibration batch)", att.to_markdown()))
        routing = None
        # MoE: routing flips, expert load and per-expert SQNR vs float (when any experts were quantized)
        if self.moe and any(isinstance(m, QuantExperts) for m in run.model.modules()):
            routing = routing_report(loaded.model, run.model, texts.calib, weight_db=run.experts_weight_db)
            say(routing.to_markdown())
            res.sites_markdown.append(("MoE routing (calibration batches, against the float model)",
                                       routing.to_markdown()))
        return RecipeResult(job, run, res, list(zip(reps, labels)), routing, dtype_name=self.dtype_name)

    def write(self, result: RecipeResult, out: str | Path, *, save: bool = True, overwrite: bool = False) -> None:
        """Write the checkpoint (save=False: the report only) and the report (markdown + PNGs) into
        `out`, staged: an error or Ctrl-C leaves `out` as it was. Rank 0 only under torchrun."""
        out = Path(out)
        result.out = out
        if D.rank() != 0:
            return
        res = result.report
        with staged(out, overwrite) as stage:
            if save:
                save_compressed(result.run.model, stage, result.job.recipe, tokenizer=self.loaded.tokenizer,
                                overwrite=True, dtype=self.dtype)
                res.checkpoint = str(out)
                res.bytes_after = checkpoint_bytes(stage)
                result.saved = True
            reps, labels = [r for r, _ in result.sites], [label for _, label in result.sites]
            png = optional_png(plot_sites, reps, str(stage / "lowbit_sites.png"), labels=labels) if reps else None
            if result.routing is not None:
                if optional_png(plot_routing, result.routing, str(stage / "lowbit_routing.png")):
                    res.extra += ["![MoE routing: flips and expert load](lowbit_routing.png)", ""]
            write_report(res, stage, png)
        if res.checkpoint:
            self.say(f"checkpoint: {res.checkpoint}")
