"""What a quantize-and-evaluate job works on: the model (embedded, GGUF or a Hugging Face
directory), its texts and the one metric it is judged by.

Text roles are kept apart: perplexity on the first `tokens` of the Wikipedia file ("eval"),
calibration and the per-site report on articles from the end of the file ("calib"), the
clipping report of static scales on Spanish Wikipedia (text the calibration never saw)."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch


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
    from lowbit.evaluation import embedded
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
    from lowbit.evaluation.embedded import wiki_articles, wiki_token_ids, windows
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
    from lowbit.evaluation.evaluate import embedding_cosine, perplexity
    if loaded.kind == "causal":
        return perplexity(model, texts.eval_ids, window, progress=progress, desc=desc)
    if reference is None:
        return 1.0
    return float(embedding_cosine(reference, model, loaded.tokenizer, texts.sentences).mean())
