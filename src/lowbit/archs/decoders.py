"""Decoder families, declared: which norm feeds which Linears, how its gain applies, which Linears
share an input, which Linears write the residual stream, and what sits where the algorithms must
not fold. Algorithms that fold or re-wire (SmoothQuant, AWQ, rotation, shared-input merging, the
layer-by-layer loader) read this map instead of probing attributes, so a family they were not
written for is refused by name rather than silently mis-folded.

Paths are relative to one decoder layer (e.g. "self_attn.q_proj"); `Decoder.layers`,
`embed`, `final_norm` and `lm_head` are relative to the *CausalLM model.

Adding a family: one `Decoder(...)` entry below, checked against the transformers modeling file
(read the decoder layer's forward: a norm whose output also reaches the residual stream, or a
norm applied to a branch *output*, is a post-norm, not a feed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Feed:
    """A norm whose output is read by `linears` and by nothing else (a fold point)."""
    norm: str
    linears: tuple[str, ...]


@dataclass(frozen=True)
class Gated:
    """down_proj reads act(gate) * up: linear in up's output rows, which can carry a fold.
    producer: the Linear writing the up rows; rows: "all" or "second_half" (a fused gate_up_proj
    whose output is chunked (gate, up))."""
    producer: str
    rows: str
    consumer: str


@dataclass(frozen=True)
class Decoder:
    family: str
    model_types: tuple[str, ...]          # transformers config.model_type values
    layer_classes: tuple[str, ...]        # decoder-layer class names
    norm: str                             # "rms" or "layernorm" (subtracts the mean: no rotation)
    gain: str                             # "w": x_hat * w;  "1+w": x_hat * (1 + w) (Gemma)
    feeds: tuple[Feed, ...]               # pre-norms -> the Linears reading them only
    gated: Gated | None                   # the up -> down fold
    writers: tuple[str, ...]              # Linears whose output is added to the residual stream
    post_norms: tuple[str, ...] = ()      # norms on a branch's output before the residual add
    unfed: tuple[tuple[str, ...], ...] = ()  # Linears reading the residual stream un-normed
    shared: tuple[tuple[str, ...], ...] = ()  # sibling Linears reading one input (merge candidates)
    qk_norms: tuple[str, ...] = ()        # norms on q / k after the projection (outputs: no fold)
    biased: tuple[str, ...] = ()          # Linears that carry a bias in this family
    softcap: bool = False                 # attention / final-logit soft-capping (tanh)
    parallel: bool = False                # attention and MLP read the same norm output
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    notes: tuple[str, ...] = field(default=())

    @property
    def gain_offset(self) -> float:
        """c in x_hat * (c + w)."""
        return 1.0 if self.gain == "1+w" else 0.0

    def readers(self) -> tuple[str, ...]:
        """Every Linear reading the residual stream (through a pre-norm or directly)."""
        return tuple(l for f in self.feeds for l in f.linears) + tuple(l for u in self.unfed for l in u)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GU = ("mlp.gate_proj", "mlp.up_proj")
_WRITERS = ("self_attn.o_proj", "mlp.down_proj")
_UP_DOWN = Gated("mlp.up_proj", "all", "mlp.down_proj")


def _llama_like(family: str, model_types: tuple[str, ...], layer: str, gain: str = "w", **kw) -> Decoder:
    """Pre-norm decoder: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up (the MLP's input norm)."""
    return Decoder(family, model_types, (layer,), "rms", gain,
                   (Feed("input_layernorm", _QKV), Feed("post_attention_layernorm", _GU)),
                   _UP_DOWN, _WRITERS, shared=(_QKV, _GU), **kw)


def _gemma(family: str, model_types: tuple[str, ...], layer: str, **kw) -> Decoder:
    # post_attention_layernorm normalizes the attention OUTPUT; pre_feedforward_layernorm feeds the MLP
    return Decoder(family, model_types, (layer,), "rms", "1+w",
                   (Feed("input_layernorm", _QKV), Feed("pre_feedforward_layernorm", _GU)),
                   _UP_DOWN, _WRITERS, post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
                   shared=(_QKV, _GU), softcap=True, **kw)


DECODERS: tuple[Decoder, ...] = (
    _llama_like("Llama", ("llama",), "LlamaDecoderLayer"),
    _llama_like("Mistral", ("mistral",), "MistralDecoderLayer"),
    _llama_like("Qwen2", ("qwen2",), "Qwen2DecoderLayer", biased=_QKV),
    _llama_like("Qwen3", ("qwen3",), "Qwen3DecoderLayer", qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    _llama_like("Granite", ("granite",), "GraniteDecoderLayer",
                notes=("embedding / residual / attention multipliers and logits_scaling are scalars: they commute "
                       "with every fold",)),
    # Gemma (1): Llama's layout with x_hat * (1 + w) norms and a scaled embedding (a scalar)
    _llama_like("Gemma", ("gemma",), "GemmaDecoderLayer", gain="1+w"),
    _gemma("Gemma 2", ("gemma2",), "Gemma2DecoderLayer"),
    _gemma("Gemma 3", ("gemma3_text", "gemma3"), "Gemma3DecoderLayer",
           qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    Decoder("Phi-3", ("phi3",), ("Phi3DecoderLayer",), "rms", "w",
            (Feed("input_layernorm", ("self_attn.qkv_proj",)), Feed("post_attention_layernorm", ("mlp.gate_up_proj",))),
            Gated("mlp.gate_up_proj", "second_half", "mlp.down_proj"), _WRITERS),
    # OLMo 2 normalizes the branch outputs; q/k/v and gate/up read the residual stream itself
    Decoder("OLMo 2", ("olmo2",), ("Olmo2DecoderLayer",), "rms", "w", (), _UP_DOWN, _WRITERS,
            post_norms=("post_attention_layernorm", "post_feedforward_layernorm"), unfed=(_QKV, _GU),
            shared=(_QKV, _GU), qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    # Cohere: one LayerNorm (mean subtracted, no bias) feeds attention and MLP in parallel
    Decoder("Cohere", ("cohere",), ("CohereDecoderLayer",), "layernorm", "w",
            (Feed("input_layernorm", _QKV + _GU),), _UP_DOWN, _WRITERS, shared=(_QKV, _GU), parallel=True),
)


class UnsupportedArchitecture(ValueError):
    """A model or decoder layer of a family the map does not declare, or whose modules differ from its entry."""


def _known() -> str:
    return ", ".join(f"{d.family} ({'/'.join(d.model_types)})" for d in DECODERS)


def _model_type(model: torch.nn.Module) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    return getattr(text, "model_type", None) or getattr(cfg, "model_type", None)


def by_layer_class(name: str) -> Decoder | None:
    """The entry whose decoder-layer class is `name`, or None."""
    return next((d for d in DECODERS if name in d.layer_classes), None)


def decoder_for(model: torch.nn.Module, check: bool = True) -> Decoder:
    """The family entry of a transformers decoder model (by config.model_type, then by the class of
    its decoder layers) or of a single decoder layer; UnsupportedArchitecture names the model type /
    class and what an entry needs. check: the entry's modules must exist as declared (its Linears
    still nn.Linear: what a fold needs)."""
    d = by_layer_class(type(model).__name__)
    if d is not None:
        if check:
            check_layer(model, d)
        return d
    mt = _model_type(model)
    d = next((d for d in DECODERS if mt in d.model_types), None)
    classes = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")})
    if d is None:
        d = next((by_layer_class(c) for c in classes if by_layer_class(c) is not None), None)
    if d is None:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} (model_type={mt!r}, decoder layers {classes or 'none found'}) is not in "
            f"lowbit's decoder map (lowbit.archs.decoders): folding or rotating it could silently change the "
            f"model. Known families: {_known()}. A new family needs an entry naming which norm feeds which "
            "Linears, how its gain applies (w or 1 + w), its post-norms and its residual writers")
    layers = decoder_layers(model, d)
    if not layers:
        raise UnsupportedArchitecture(
            f"{type(model).__name__} (model_type={mt!r}) maps to {d.family}, whose decoder layers are "
            f"{list(d.layer_classes)}, but it has {classes or 'no *DecoderLayer'}: extend the entry's layer_classes "
            "once the new class is checked against it")
    for _, layer in layers if check else ():
        check_layer(layer, d)
    return d


def decoder_layers(model: torch.nn.Module, d: Decoder) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every decoder layer of family `d` in `model` (the model itself if it is one)."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in d.layer_classes]


def check_layer(layer: torch.nn.Module, d: Decoder) -> None:
    """UnsupportedArchitecture unless every module the entry names exists on `layer` as declared."""
    def has(path, kind):
        try:
            return isinstance(layer.get_submodule(path), kind)
        except AttributeError:
            return False
    lin = [p for f in d.feeds for p in f.linears] + list(d.writers) + [p for u in d.unfed for p in u]
    if d.gated is not None:
        lin += [d.gated.producer, d.gated.consumer]
    missing = [p for p in lin if not has(p, torch.nn.Linear)]
    missing += [p for p in [f.norm for f in d.feeds] + list(d.post_norms) + list(d.qk_norms)
                if not has(p, torch.nn.Module)]
    if missing:
        raise UnsupportedArchitecture(
            f"{type(layer).__name__} is mapped as {d.family} but lacks {missing} (or they are no longer "
            "nn.Linear: fold before quantizing); its lowbit.archs.decoders entry does not match this model")
    for f in d.feeds:
        if getattr(layer.get_submodule(f.norm), "bias", None) is not None:
            raise UnsupportedArchitecture(f"{d.family}: {f.norm} has a bias; the map declares a gain-only norm")


def sibling_groups(model: torch.nn.Module) -> tuple[tuple[str, ...], ...] | None:
    """The attribute names of sibling Linears that read one input (lowbit.nn.shared_input's groups)
    in a mapped decoder, e.g. (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")); () for a
    family with fused projections (Phi-3); None for a model the map does not know (the caller keeps
    its own default: merging is exact for any model, shared_input checks the members' input object)."""
    try:
        d = decoder_for(model, check=False)
    except UnsupportedArchitecture:
        return None
    out = []
    for g in d.shared:
        parents = {p.rpartition(".")[0] for p in g}
        if len(parents) == 1:
            out.append(tuple(p.rpartition(".")[2] for p in g))
    return tuple(out)
