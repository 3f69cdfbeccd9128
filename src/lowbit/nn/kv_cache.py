"""A quantized KV cache for transformers' `generate` and lowbit's attention.

    kv = calibrate_kv_cache(model, batches, "fp8")          # static scales need calibration data
    out = model.generate(ids, past_key_values=kv.new_cache(), ...)
    logits = model(ids, **{cache_kwarg(model): kv.new_cache()}).logits   # 5.x: cache=, 4.x: past_key_values=

Each layer stores its keys and values as lowbit.ops.kv_quant.KVQuant (codes and scales; the
arithmetic is lowbit.quantize's) in preallocated buffers: they grow by doubling (amortized O(1)
copies per token, where appending by concatenation copied the whole cache every step), or hold
max_cache_len tokens from the first write (kv.new_cache(max_cache_len=N); an update past N raises).
`update` quantizes the new states, writes them in place after the cached tokens, and returns
the filled tokens dequantized in the states' dtype, so any attention implementation reads the
values the cache holds (exactly in a float32 model; a bf16 model rounds them to bf16, as its own
attention would); lowbit.ops.attention reads the codes directly (`layer.quantized()`).
Prefill states are quantized too (unlike transformers' Fp8QuantizedLayer, which attends the first
chunk unquantized): a cached run and a full forward through a fresh cache see the same values.

Quantized attention inside the model (an attention implementation named "lowbit"):
    enable_quantized_attention(model, AttnSpec(q_format="fp8_e4m3fn", p_format="fp8_e4m3fn"))
makes every attention module compute lowbit.ops.attention (Q per token and head, P per (row, key
block), O in fp32 across the online-softmax rescales) on the keys and values its cache returns.
Causal masks only: a padding mask is refused (NotImplementedError), never ignored.

Writes: a CUDA decode step (one token) of an fp8 / int8 cache with scales per tensor, head or token
goes through lowbit.ops.triton.kv_append.append_kv (one launch per tensor, the position a device
tensor); every other write (CPU, prefill chunks, int4, group scales, float64 states) through
quantize_kv, its codes copied into the buffers. Both give the same codes bit for bit.

Refused: NaN/Inf states (a clear error naming the layer, batch, head, token). quantize_kv refuses
them before writing. append_kv cannot without syncing the host every step, so it records the first
bad (token, batch, head) on the device as it writes; the layer copies that record to pinned host
memory asynchronously and raises the same error at its next update (one step late: the bad step's
attention has run, its codes are stored), at batch_repeat_interleave / batch_select_indices, or
when asked (LowbitKVCache.check_finite(), one sync); crop and reset drop records of removed tokens.
Also refused: a static scheme without calibrated scales, scales whose shape disagrees with the
scheme (a per-tensor scale where per-head was declared) or with the model's KV heads, and a
quantized cache handed to a model whose attached quantization (its kv_cache_scheme and k_scale /
v_scale) is another.
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
from lowbit.ops.dispatch import KV_APPEND_DTYPES, have_triton, kv_append_supports
from lowbit.ops.kv_quant import (KVQuant, KVScheme, alloc_tokens, observe_amax, quantize_kv, static_scale,
                                 write_tokens)


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

    def new_cache(self, max_cache_len: int | None = None, append_kernel: bool | None = None) -> "LowbitKVCache":
        """An empty cache. max_cache_len: tokens each layer's buffers hold from the first write
        (a static preallocation; an update past it raises); None: buffers grow by doubling.
        append_kernel: LowbitKVLayer's (None: append_kv for CUDA decode steps)."""
        return LowbitKVCache(self, max_cache_len=max_cache_len, append_kernel=append_kernel)

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


_CLEAN = torch.iinfo(torch.int64).max        # append_kv's NaN/Inf record before anything is found


class LowbitKVLayer(DynamicLayer):
    """One layer's quantized keys and values (see module docstring), in buffers of `capacity`
    tokens that grow by doubling (or hold max_cache_len tokens from the first write); the first
    `cumulative_length` tokens are filled. append_kernel: None uses append_kv for CUDA decode
    steps; True / False force it on / off (True on CPU needs the Triton interpreter).
    get_max_length stays DynamicLayer's -1 with max_cache_len too: update returns the filled tokens,
    never max_cache_len of them, and callers size masks by get_max_length when it is set."""

    is_croppable = True

    def __init__(self, scheme: KVScheme, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 layer_idx: int | None = None, max_cache_len: int | None = None, append_kernel: bool | None = None):
        super().__init__()
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive int (tokens) or None (grow as needed), "
                             f"got {max_cache_len!r}")
        self.scheme, self.k_scale, self.v_scale, self.layer_idx = scheme, k_scale, v_scale, layer_idx
        self.max_cache_len, self.append_kernel = max_cache_len, append_kernel
        self._k: KVQuant | None = None             # the buffers, all `capacity` tokens
        self._v: KVQuant | None = None
        self._pos: torch.Tensor | None = None      # int32 [1] on the device: append_kv's write position
        self._pos_at = -1                          # the value _pos holds (host copy; -1: unknown)
        self._bad: torch.Tensor | None = None      # int64 [2]: append_kv's NaN/Inf record for K, V
        self._bad_host: torch.Tensor | None = None  # its asynchronous copy in pinned host memory (CUDA)
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.codes.shape[2]

    def _where(self) -> str:
        return f"layer {self.layer_idx} " if self.layer_idx is not None else ""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._raise_if_bad(self._bad_host)           # an earlier kernel-written step's record, read without a sync
        if self._kernel_step(key_states, value_states):
            self._append_kernel(key_states, value_states)
        else:
            where = self._where()
            kq = quantize_kv(key_states, self.scheme, self._scale(self.k_scale, key_states),
                             name=f"{where}key states")
            vq = quantize_kv(value_states, self.scheme, self._scale(self.v_scale, value_states),
                             name=f"{where}value states")
            n = self.cumulative_length
            self._reserve(n + key_states.shape[-2], kq, vq)
            write_tokens(self._k, kq, n)
            write_tokens(self._v, vq, n)
            self.cumulative_length = n + key_states.shape[-2]
        qk, qv = self.quantized()
        return qk.dequantize(key_states.dtype), qv.dequantize(value_states.dtype)

    def _kernel_step(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """append_kv writes this step: one token of fp8 / int8 states per tensor / head / token,
        into buffers that already exist (the first write takes quantize_kv) and fit the states."""
        use = (k.is_cuda and have_triton()) if self.append_kernel is None else self.append_kernel
        if not use or self._k is None or k.dim() != 4 or k.shape[2] != 1 or v.shape != k.shape:
            return False
        if not kv_append_supports(self.scheme) or k.dtype not in KV_APPEND_DTYPES or v.dtype not in KV_APPEND_DTYPES:
            return False
        B, H, _, D = self._k.codes.shape
        return (k.shape[0], k.shape[1], k.shape[3]) == (B, H, D) and self._k.codes.device == k.device

    def _append_kernel(self, k: torch.Tensor, v: torch.Tensor) -> None:
        from lowbit.ops.triton.kv_append import append_kv    # triton is an optional dependency
        n = self.cumulative_length
        self._reserve(n + 1)
        dev = k.device
        if self._pos is None or self._pos.device != dev:
            self._pos, self._pos_at = torch.zeros(1, dtype=torch.int32, device=dev), 0
        if self._pos_at != n:                          # after a quantize_kv write, crop or reset
            self._pos.fill_(n)
        if self._bad is None or self._bad.device != dev:
            self._bad = torch.full((2,), _CLEAN, dtype=torch.int64, device=dev)
            self._bad_host = torch.full((2,), _CLEAN, dtype=torch.int64, pin_memory=True) if k.is_cuda else self._bad
        append_kv(self._k, k, self._pos, self._bad[0:1])
        append_kv(self._v, v, self._pos, self._bad[1:2])
        self._pos.add_(1)                              # stays on the device: no host value enters the step
        self._pos_at = n + 1
        if self._bad_host is not self._bad:
            self._bad_host.copy_(self._bad, non_blocking=True)
        self.cumulative_length = n + 1

    def _reserve(self, tokens: int, kq: KVQuant | None = None, vq: KVQuant | None = None) -> None:
        """Buffers that hold `tokens` tokens: the same ones when they do, else new ones of
        max_cache_len tokens or of max(tokens, 2 * capacity) (amortized O(1) copies per token),
        the filled prefix copied over. kq / vq (new quantized states) are the template of a first
        allocation, or of a new one when an empty cache meets another batch / head / dim / device."""
        if self.max_cache_len is not None and tokens > self.max_cache_len:
            raise ValueError(f"{self._where()}KV cache: max_cache_len={self.max_cache_len} tokens, and this update "
                             f"would make {tokens} ({self.cumulative_length} cached + "
                             f"{tokens - self.cumulative_length} new): build the cache with a larger max_cache_len "
                             "(KVCacheQuant.new_cache(max_cache_len=...)) or with None to let it grow")
        if self._k is not None and kq is not None and self.cumulative_length == 0 and not self._fits(kq):
            self._k = self._v = None                   # reset, then another batch: the old buffers do not fit
        if self._k is not None and tokens <= self.capacity:
            return
        cap = self.max_cache_len if self.max_cache_len is not None else max(tokens, 2 * self.capacity)
        n = self.cumulative_length
        for name, like in (("_k", kq), ("_v", vq)):
            old = getattr(self, name)
            new = alloc_tokens(like if old is None else old, cap)
            if old is not None and n:
                write_tokens(new, old.select_tokens(slice(0, n)), 0)
            setattr(self, name, new)

    def _fits(self, q: KVQuant) -> bool:
        B, H, _, Dc = self._k.codes.shape
        return (q.codes.shape[0], q.codes.shape[1], q.codes.shape[3]) == (B, H, Dc) and \
            q.codes.device == self._k.codes.device and q.codes.dtype == self._k.codes.dtype

    def _scale(self, s, like):
        return None if s is None else s.to(like.device)

    def _raise_if_bad(self, record: torch.Tensor | None) -> None:
        """Raise quantize_kv's NaN/Inf refusal for a kernel-written token that append_kv recorded."""
        if record is None:
            return
        found = record.tolist()
        if found[0] == _CLEAN and found[1] == _CLEAN:
            return
        B, H = self._k.codes.shape[:2]
        side, first = ("key", found[0]) if found[0] <= found[1] else ("value", found[1])
        t, row = divmod(first, B * H)
        raise ValueError(f"{self._where()}{side} states held NaN/Inf value(s), first at batch {row // H}, head "
                         f"{row % H}, token {t}: a quantized cache cannot store them (and one would poison a shared "
                         "scale); fix the model's activations before caching (found by append_kv's device-side "
                         "check of a decode step; crop or reset the cache to drop the token)")

    def check_finite(self) -> None:
        """Raise if a kernel-written step held NaN/Inf (reads the device record: one host sync)."""
        self._raise_if_bad(self._bad)

    def _forget_bad(self, from_token: int) -> None:
        """Clear records of tokens >= from_token (crop, reset removed them)."""
        if self._bad is None:
            return
        B, H = self._k.codes.shape[:2]
        gone = self._bad >= from_token * B * H
        self._bad.masked_fill_(gone, _CLEAN)
        if self._bad_host is not self._bad:
            self._bad_host.copy_(self._bad)            # synchronous: the next update must not see the old record

    def quantized(self) -> tuple[KVQuant, KVQuant]:
        """The cache as stored (what lowbit.ops.attention and the Triton kernel read): views of the
        filled tokens of the buffers (token stride capacity * D, not T * D)."""
        if self._k is None or self.cumulative_length == 0:
            raise ValueError("the cache layer is empty: run a forward pass first")
        keep = slice(0, self.cumulative_length)
        return self._k.select_tokens(keep), self._v.select_tokens(keep)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> int:
        """Bytes of the filled tokens (codes + scales): what the cache holds, as a contiguous cache
        would store it; capacity_nbytes() is what the buffers take."""
        if self._k is None or self.cumulative_length == 0:
            return 0
        qk, qv = self.quantized()
        return qk.nbytes() + qv.nbytes()

    def capacity_nbytes(self) -> int:
        """Bytes the buffers take (all `capacity` tokens, filled or not)."""
        return 0 if self._k is None else self._k.nbytes() + self._v.nbytes()

    def reset(self) -> None:
        """Empty the cache; the buffers are kept for the next generation (a batch, head count or
        head_dim that differs makes new ones at the first write)."""
        self._forget_bad(0)
        self.cumulative_length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: the tokens to remove from the end")
        if tokens_to_remove == 0 or self._k is None:
            return
        self.cumulative_length = max(0, self.cumulative_length + tokens_to_remove)
        self._forget_bad(self.cumulative_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows of the filled tokens reordered in place (the buffers stay where they are)."""
        n = self.cumulative_length
        if self._k is None or n == 0:
            return
        for q in (self._k, self._v):
            idx = beam_idx.to(q.codes.device)
            q.codes[:, :, :n] = q.codes[:, :, :n].index_select(0, idx)
            if q.scheme.dynamic:
                q.scale[:, :, :n] = q.scale[:, :, :n].index_select(0, idx)

    def _map_batch(self, fn) -> None:
        """fn applied to the batch axis of the whole buffers (codes, dynamic scales)."""
        if self._k is None:
            return
        self.check_finite()                            # a record's (batch, head) is read against the old batch
        for name in ("_k", "_v"):
            t = getattr(self, name)
            scale = fn(t.scale) if t.scheme.dynamic else t.scale
            setattr(self, name, KVQuant(fn(t.codes), scale, t.scheme))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def _move(self, device) -> None:
        for name in ("_k", "_v"):
            t = getattr(self, name)
            scale = t.scale.to(device, non_blocking=True)
            setattr(self, name, KVQuant(t.codes.to(device, non_blocking=True), scale, t.scheme))

    def offload(self):
        if self._k is not None:
            self._move("cpu")

    def prefetch(self):
        if self._k is not None and self._k.codes.device != self.device:
            self._move(self.device)


class LowbitKVCache(Cache):
    """A transformers Cache of LowbitKVLayer, one per decoder layer (max_cache_len, append_kernel:
    LowbitKVLayer's)."""

    def __init__(self, quant: KVCacheQuant, max_cache_len: int | None = None, append_kernel: bool | None = None):
        layers = [LowbitKVLayer(quant.scheme, *quant.layer_scales(i), layer_idx=i, max_cache_len=max_cache_len,
                                append_kernel=append_kernel) for i in range(quant.num_layers)]
        super().__init__(layers=layers)
        self.quant = quant   # max_cache_len lives on the layers: some transformers make Cache.max_cache_len read-only

    def nbytes(self) -> int:
        """Bytes of the cached tokens' codes and scales, over all layers (LowbitKVLayer.nbytes)."""
        return sum(layer.nbytes() for layer in self.layers)

    def capacity_nbytes(self) -> int:
        """Bytes the layers' buffers take, filled or not."""
        return sum(layer.capacity_nbytes() for layer in self.layers)

    def check_finite(self) -> None:
        """Raise if a kernel-written decode step stored NaN/Inf states (one host sync per layer)."""
        for layer in self.layers:
            layer.check_finite()


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


def module_attn_spec(module, scaling: float | None) -> ar.AttnSpec:
    """The AttnSpec lowbit's attention computes for `module` (enable_quantized_attention's, default
    AttnSpec()): causal, with the softmax scale the model passes (None: 1 / sqrt(head_dim))."""
    spec = getattr(module, "lowbit_attn_spec", None) or ar.AttnSpec()
    return dataclasses.replace(spec, causal=True, sm_scale=scaling)


def lowbit_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function signature; returns ([B, T, Hq, D], None)."""
    if dropout:
        raise NotImplementedError("lowbit attention is for inference: dropout must be 0 (call model.eval())")
    spec = module_attn_spec(module, scaling)
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
