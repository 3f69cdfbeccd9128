"""A quantized KV cache for transformers' `generate` and lowbit's attention.

    kv = calibrate_kv_cache(model, batches, "fp8")          # static scales need calibration data
    out = model.generate(ids, past_key_values=kv.new_cache(), ...)
    logits = model(ids, **{cache_kwarg(model): kv.new_cache()}).logits   # 5.x: cache=, 4.x: past_key_values=

Each layer stores its keys and values as lowbit.ops.kv_quant.KVQuant (codes and scales; the
arithmetic is lowbit.quantize's). `update` quantizes the new states, appends them, and returns
the whole cache dequantized in the states' dtype, so any attention implementation reads the
values the cache holds (exactly in a float32 model; a bf16 model rounds them to bf16, as its own
attention would); lowbit.ops.attention reads the codes directly (`layer.quantized()`).
Prefill states are quantized too (unlike transformers' Fp8QuantizedLayer, which attends the first
chunk unquantized): a cached run and a full forward through a fresh cache see the same values.

Quantized attention inside the model (an attention implementation named "lowbit"):
    enable_quantized_attention(model, AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn"))
makes every attention module compute lowbit.ops.attention (Q per token and head, P per (row, key
block), O in fp32 across the online-softmax rescales) on the keys and values its cache returns.
Causal masks only: a padding mask is refused (NotImplementedError), never ignored.

Refused: NaN/Inf states (a clear error naming the layer, batch, head, token), a static scheme
without calibrated scales, scales whose shape disagrees with the scheme (a per-tensor scale where
per-head was declared) or with the model's KV heads, and a quantized cache handed to a model whose
attached quantization (its kv_cache_scheme and k_scale / v_scale) is another.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from lowbit.ops import attention_reference as ar
from lowbit.ops.attention import attention
from lowbit.ops.kv_quant import KVQuant, KVScheme, cat_tokens, observe_amax, quantize_kv, static_scale


@dataclass
class KVCacheQuant:
    """A model's KV-cache quantization: the scheme and, for static schemes, per-layer scales
    (k_scales[i], v_scales[i]: float32 [1,1,1,1] or [1,H,1,1])."""

    scheme: KVScheme
    num_layers: int
    k_scales: list[torch.Tensor] | None = None
    v_scales: list[torch.Tensor] | None = None

    def __post_init__(self):
        self.scheme = KVScheme.parse(self.scheme)
        if self.scheme.dynamic:
            if self.k_scales is not None or self.v_scales is not None:
                raise ValueError(f"{self.scheme} scales are dynamic; k_scales / v_scales must be None")
            return
        for name in ("k_scales", "v_scales"):
            s = getattr(self, name)
            if s is None or len(s) != self.num_layers:
                raise ValueError(f"KVCacheQuant: {self.scheme} is static and needs {name} for all {self.num_layers} "
                                 "layers (calibrate_kv_cache computes them)")

    def new_cache(self) -> "LowbitKVCache":
        return LowbitKVCache(self)

    def same_as(self, other: "KVCacheQuant") -> bool:
        """The same scheme, layer count and (static) scale values."""
        if self is other:
            return True
        if self.scheme != other.scheme or self.num_layers != other.num_layers:
            return False
        if self.scheme.dynamic:
            return True
        return all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
                   for mine, theirs in ((self.k_scales, other.k_scales), (self.v_scales, other.v_scales))
                   for a, b in zip(mine, theirs))

    def layer_scales(self, i: int):
        if self.scheme.dynamic:
            return None, None
        return self.k_scales[i], self.v_scales[i]


class LowbitKVLayer(DynamicLayer):
    """One layer's quantized keys and values (see module docstring)."""

    is_croppable = True

    def __init__(self, scheme: KVScheme, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 layer_idx: int | None = None):
        super().__init__()
        self.scheme, self.k_scale, self.v_scale, self.layer_idx = scheme, k_scale, v_scale, layer_idx
        self.qk: KVQuant | None = None
        self.qv: KVQuant | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        where = f"layer {self.layer_idx} " if self.layer_idx is not None else ""
        kq = quantize_kv(key_states, self.scheme, self._scale(self.k_scale, key_states), name=f"{where}key states")
        vq = quantize_kv(value_states, self.scheme, self._scale(self.v_scale, value_states),
                         name=f"{where}value states")
        self.qk, self.qv = cat_tokens(self.qk, kq), cat_tokens(self.qv, vq)
        self.cumulative_length += key_states.shape[-2]
        return self.qk.dequantize(key_states.dtype), self.qv.dequantize(value_states.dtype)

    def _scale(self, s, like):
        return None if s is None else s.to(like.device)

    def quantized(self) -> tuple[KVQuant, KVQuant]:
        """The cache as stored (what lowbit.ops.attention and the Triton kernel read)."""
        if self.qk is None:
            raise ValueError("the cache layer is empty: run a forward pass first")
        return self.qk, self.qv

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        return 0 if self.qk is None else self.qk.nbytes() + self.qv.nbytes()

    def reset(self) -> None:
        self.qk = self.qv = None
        self.cumulative_length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: the tokens to remove from the end")
        if tokens_to_remove == 0 or self.qk is None:
            return
        keep = slice(0, self.cumulative_length + tokens_to_remove)
        self.qk, self.qv = self.qk.select_tokens(keep), self.qv.select_tokens(keep)
        self.cumulative_length += tokens_to_remove

    def _map_batch(self, fn) -> None:
        if self.qk is None:
            return
        for name in ("qk", "qv"):
            t = getattr(self, name)
            scale = fn(t.scale) if t.scheme.dynamic else t.scale
            setattr(self, name, KVQuant(fn(t.codes), scale, t.scheme))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.qk is not None and self.qk.codes.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))


class LowbitKVCache(Cache):
    """A transformers Cache of LowbitKVLayer, one per decoder layer."""

    def __init__(self, quant: KVCacheQuant):
        layers = [LowbitKVLayer(quant.scheme, *quant.layer_scales(i), layer_idx=i) for i in range(quant.num_layers)]
        super().__init__(layers=layers)
        self.quant = quant

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class _ObserverLayer(DynamicLayer):
    """Calibration: keeps states unquantized (as DynamicLayer) and records the amax a static
    scheme's scale covers."""

    def __init__(self, scheme: KVScheme, stats: dict, layer_idx: int):
        super().__init__()
        self.scheme, self.stats, self.layer_idx = scheme, stats, layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        for side, x in (("k", key_states), ("v", value_states)):
            a = observe_amax(x, self.scheme, f"layer {self.layer_idx} {'key' if side == 'k' else 'value'} states")
            key = (side, self.layer_idx)
            self.stats[key] = a if key not in self.stats else torch.maximum(self.stats[key], a)
        return super().update(key_states, value_states, *args, **kwargs)


def cache_kwarg(model) -> str:
    """The name under which `model.forward` takes its cache: "cache" (transformers 5.x) or
    "past_key_values" (4.x). A name the forward does not declare would vanish into its **kwargs:
    the model would then build its own unquantized cache and nothing would be observed."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _kv_heads(model) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None)


def num_decoder_layers(model) -> int:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.num_hidden_layers)


@torch.no_grad()
def calibrate_kv_cache(model, batches, scheme) -> KVCacheQuant:
    """KVCacheQuant for `model`: static schemes take max |state| per layer (per head for "head")
    over the calibration batches (token id tensors [B, T], or dicts of model keyword arguments);
    dynamic schemes need no data. A model with a quantized cache attached is observed unquantized."""
    scheme = KVScheme.parse(scheme)
    n = num_decoder_layers(model)
    if scheme.dynamic:
        return KVCacheQuant(scheme, n)
    stats: dict = {}
    seen = 0
    device = next(model.parameters()).device
    cache_kw = cache_kwarg(model)
    for batch in batches:
        cache = Cache(layers=[_ObserverLayer(scheme, stats, i) for i in range(n)])
        kwargs = dict(batch) if isinstance(batch, dict) else {"input_ids": batch}
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        model(**kwargs, **{cache_kw: cache}, use_cache=True)
        seen += 1
    if seen == 0 or len(stats) != 2 * n:
        raise ValueError(f"calibrate_kv_cache: {scheme} needs calibration batches that reach every one of the "
                         f"{n} layers (got {seen} batch(es), {len(stats) // 2} layer(s) observed); the cache goes to "
                         f"{type(model).__name__}.forward as {cache_kw}= and every decoder layer must write to it")
    k = [static_scale(stats[("k", i)], scheme) for i in range(n)]
    v = [static_scale(stats[("v", i)], scheme) for i in range(n)]
    return KVCacheQuant(scheme, n, k, v)


# ---------------------------------------------------------------- a model that quantizes its own cache
def attention_modules(model) -> dict[int, tuple[str, torch.nn.Module]]:
    """{layer index: (module name, attention module)}: the modules transformers gives a
    `layer_idx` and k/v projections (where compressed-tensors and vLLM keep k_scale / v_scale)."""
    found = {}
    for name, m in model.named_modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj") and hasattr(m, "v_proj"):
            if m.layer_idx in found:
                raise ValueError(f"two attention modules claim layer {m.layer_idx}: {found[m.layer_idx][0]} and {name}")
            found[m.layer_idx] = (name, m)
    return found


def _ct_shape(scale: torch.Tensor, scheme: KVScheme) -> torch.Tensor:
    # compressed-tensors' shapes: [1] (tensor), [H, 1, 1] (attn_head)
    return scale.reshape(1) if scheme.granularity == "tensor" else scale.reshape(-1, 1, 1)


def _lowbit_shape(scale: torch.Tensor, scheme: KVScheme) -> torch.Tensor:
    return scale.reshape(1, 1, 1, 1) if scheme.granularity == "tensor" else scale.reshape(1, -1, 1, 1)


def _use_quantized_cache(module, args, kwargs):
    kv = getattr(module, "lowbit_kv_cache", None)
    if kv is None or not getattr(module, "lowbit_kv_enabled", True):
        return None
    given = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(given, LowbitKVCache) and not kv.same_as(given.quant):
        raise ValueError(f"the cache handed to {type(module).__name__} quantizes {given.quant.scheme} with other scales "
                         f"than the model's kv_cache_scheme ({kv.scheme}, its k_scale / v_scale): build it with "
                         "model.lowbit_kv_cache.new_cache(), or pass no cache and let the model make one")
    if given is None or (type(given) is DynamicCache and given.get_seq_length() == 0):
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        kwargs[cache_kwarg(module)] = kv.new_cache()   # generate's fresh DynamicCache is swapped for a quantized one
        kwargs["use_cache"] = True
    return args, kwargs


def attach_kv_cache(model, kv: KVCacheQuant) -> None:
    """Make `model` quantize its KV cache: every forward without a cache (and generate's fresh
    one) gets kv.new_cache(); static scales are registered as `k_scale` / `v_scale` buffers on
    each attention module, the names and shapes compressed-tensors and vLLM load."""
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no decoder attention modules (with layer_idx, k_proj, v_proj) "
                         "that keep a KV cache: --kv-cache / kv_cache= applies to causal decoders")
    if sorted(mods) != list(range(kv.num_layers)):
        raise ValueError(f"the model's attention modules have layer indices {sorted(mods)[:8]}, the KV-cache "
                         f"quantization covers {kv.num_layers} layers: they were calibrated on another model")
    heads = _kv_heads(model)
    if kv.scheme.granularity == "head" and heads is not None:
        for i in range(kv.num_layers):
            for side, sc in zip("kv", kv.layer_scales(i)):
                if sc.numel() != heads:
                    raise ValueError(f"layer {i} {side}_scale holds {sc.numel()} per-head scales, the model has {heads} "
                                     "KV heads: the scales were calibrated on another model")
    for i, (_, m) in mods.items():
        for side in ("k", "v"):
            if f"{side}_scale" in m._buffers:
                del m._buffers[f"{side}_scale"]
        if not kv.scheme.dynamic:
            ks, vs = kv.layer_scales(i)
            m.register_buffer("k_scale", _ct_shape(ks, kv.scheme).clone())
            m.register_buffer("v_scale", _ct_shape(vs, kv.scheme).clone())
    model.lowbit_kv_cache = kv
    if getattr(model, "_lowbit_kv_hook", None) is None:
        model._lowbit_kv_hook = model.register_forward_pre_hook(_use_quantized_cache, with_kwargs=True)


class kv_cache_disabled:
    """with kv_cache_disabled(model): forwards run with transformers' own (unquantized) cache."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.lowbit_kv_enabled = False
        return self.model

    def __exit__(self, *exc):
        self.model.lowbit_kv_enabled = True


def kv_cache_from_tensors(ct_args: dict | None, tensors: dict, num_layers: int, num_kv_heads: int | None,
                          where: str) -> KVCacheQuant | None:
    """The KVCacheQuant a checkpoint describes (kv_cache_scheme + `*.k_scale` / `*.v_scale`
    tensors, which are removed from `tensors`); None when it quantizes no cache. Raises
    ValueError when the scales disagree with the scheme (missing, extra, per-tensor where
    per-head was declared, not finite and positive)."""
    names = {side: sorted((n for n in tensors if n.endswith(f".{side}_scale")), key=_layer_number)
             for side in ("k", "v")}
    if ct_args is None:
        if names["k"] or names["v"]:
            raise ValueError(f"{where}: tensors {(names['k'] + names['v'])[:3]} hold KV-cache scales but "
                             "quantization_config.kv_cache_scheme is null: the files and the config disagree")
        return None
    try:
        scheme = KVScheme.from_ct_args(ct_args)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: kv_cache_scheme: {e}") from e
    if scheme.dynamic:
        if names["k"] or names["v"]:
            raise ValueError(f"{where}: kv_cache_scheme is dynamic ({scheme}) but the files hold static scales "
                             f"{(names['k'] + names['v'])[:3]}")
        return KVCacheQuant(scheme, num_layers)
    out = {}
    for side in ("k", "v"):
        if len(names[side]) != num_layers:
            raise ValueError(f"{where}: kv_cache_scheme {scheme} is static and needs one {side}_scale per layer "
                             f"({num_layers}); found {len(names[side])}")
        if [_layer_number(n) for n in names[side]] != list(range(num_layers)):
            raise ValueError(f"{where}: {side}_scale tensors {names[side][:4]} do not name layers 0..{num_layers - 1} "
                             "once each")
        want = (1,) if scheme.granularity == "tensor" else (num_kv_heads, 1, 1)
        scales = []
        for n in names[side]:
            t = tensors.pop(n)
            if tuple(t.shape) != want or not t.is_floating_point():
                raise ValueError(f"{where}: {n} has dtype {t.dtype} shape {list(t.shape)}; kv_cache_scheme {scheme} "
                                 f"needs a float tensor of shape {list(want)}")
            t = t.to(torch.float32)
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ValueError(f"{where}: {n} must be finite and positive, got {t.flatten()[:4].tolist()}")
            scales.append(_lowbit_shape(t, scheme))
        out[side] = scales
    return KVCacheQuant(scheme, num_layers, out["k"], out["v"])


def _layer_number(name: str) -> int:
    nums = [int(p) for p in name.split(".") if p.isdigit()]
    if not nums:
        raise ValueError(f"KV scale tensor {name!r} has no layer index in its name")
    return nums[-1]


# ---------------------------------------------------------------- quantized attention in transformers
NAME = "lowbit"


def _check_causal(mask, Tq: int, Tk: int) -> None:
    if mask is None:
        return                                      # transformers skipped the mask: plain causal
    m = mask if mask.dtype == torch.bool else (mask == 0)
    want = ar.allowed_mask(Tq, Tk, True, m.device)
    if not bool((m == want).all()):
        raise NotImplementedError("lowbit attention takes causal masks only; this batch has a padding (or other) "
                                  "mask: run it unpadded, or use the model's own attention implementation")


def lowbit_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature; returns ([B, T, Hq, D], None)."""
    if dropout:
        raise NotImplementedError("lowbit attention is for inference: dropout must be 0 (call model.eval())")
    spec = getattr(module, "lowbit_attn_spec", None) or ar.AttnSpec()
    spec = dataclasses.replace(spec, causal=True, sm_scale=scaling)
    _check_causal(attention_mask, query.shape[2], key.shape[2])
    out = attention(query, key, value, spec)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, lowbit_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def enable_quantized_attention(model, spec: ar.AttnSpec | None = None) -> None:
    """Switch `model` to lowbit's quantized attention with `spec` (default AttnSpec())."""
    spec = spec or ar.AttnSpec()
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "k_proj"):
            m.lowbit_attn_spec = spec
    model.set_attn_implementation(NAME)
