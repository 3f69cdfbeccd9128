"""The quantized KV cache: codes against independent casts, bad input, and `generate` on a tiny Llama."""
import pytest
import torch

from lowbit.nn.kv_cache import KVCacheQuant, LowbitKVCache, cache_kwarg, calibrate_kv_cache
from lowbit.ops.kv_quant import KVScheme, observe_amax, quantize_kv, static_scale


def _states(rng, B=2, H=3, T=5, D=24):
    x = torch.randn(B, H, T, D, generator=rng)
    return x * torch.tensor([0.3, 1.0, 4.0][:H]).reshape(1, H, 1, 1)


def test_fp8_token_codes_match_torch_cast(rng):
    x = _states(rng)
    q = quantize_kv(x, KVScheme("fp8", "token"))
    s = x.abs().amax(-1, keepdim=True) / 448           # lowbit.quantize's rule, written out
    assert torch.equal(q.scale, s)
    want = (x / s).to(torch.float8_e4m3fn).float() * s  # |x / s| <= 448: torch's RNE cast, no overflow
    assert torch.equal(q.dequantize(), want)


def test_static_head_scales_and_int8_codes(rng):
    x = _states(rng)
    sch = KVScheme("int8", "head")
    s = static_scale(observe_amax(x, sch), sch)
    assert s.shape == (1, 3, 1, 1)
    assert torch.equal(s, x.abs().amax(dim=(0, 2, 3), keepdim=True) / 127)
    q = quantize_kv(x, sch, s)
    assert torch.equal(q.codes, torch.round(x / s).clamp(-127, 127).to(torch.int8))
    y = x.clone()
    y[0, 1, 2, 3] = 1e6                                  # beyond the calibrated range: clamped, never wrapped
    assert int(quantize_kv(y, sch, s).codes[0, 1, 2, 3]) == 127


def test_fp8_head_and_tensor_codes_match_torch_cast_bit_for_bit(rng):
    # GQA-shaped states as the cache holds them, [B, KV heads, T, D]: one static scale per KV head
    # (axis 1), or one for all; codes against torch's float8_e4m3fn cast of x / s, bit for bit
    x = _states(rng, B=2, H=3, T=7, D=40)
    for gran, amax in (("head", x.abs().amax(dim=(0, 2, 3), keepdim=True)), ("tensor", x.abs().amax().reshape(1, 1, 1, 1))):
        sch = KVScheme("fp8", gran)
        s = static_scale(observe_amax(x, sch), sch)
        assert torch.equal(s, amax / 448)
        y = x.clone()
        y[1, 2, 3, 4] = 3 * float(amax.flatten()[-1])      # beyond the calibrated range: saturates at 448
        want = (y / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(quantize_kv(y, sch, s).codes, want)


def test_int4_group_codes(rng):
    x = _states(rng)
    q = quantize_kv(x, KVScheme("int4", "group", 8))
    g = x.reshape(2, 3, 5, 3, 8)
    s = g.abs().amax(-1) / 7
    assert torch.equal(q.scale, s)
    want = torch.round(g / s[..., None]).clamp(-7, 7).to(torch.int8).reshape(x.shape)
    # stored two per byte: element 2j in the low nibble, 2j+1 in the high, 4-bit two's complement;
    # unpacked here with plain integer arithmetic (not lowbit.packing)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 5, 12) and q.shape == (2, 3, 5, 24)
    b = q.codes.to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    nib = torch.stack((lo, hi), dim=-1).reshape(x.shape)
    assert torch.equal(torch.where(nib >= 8, nib - 16, nib).to(torch.int8), want)
    assert torch.equal(q.unpacked().codes, want)
    assert torch.equal(q.dequantize(), (want.float().reshape(g.shape) * s[..., None]).reshape(x.shape))


def test_int4_cache_bytes_at_most_0_3_of_bf16(rng):
    # a Llama-shaped layer (8 KV heads, head_dim 128) over 300 tokens: the bytes the cache tensors
    # really hold (codes + float32 scales) against bf16 keys and values
    k = torch.randn(1, 8, 300, 128, generator=rng, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 300, 128, generator=rng, dtype=torch.bfloat16)
    bf16 = sum(t.numel() * t.element_size() for t in (k, v))
    for group, want in ((32, 0.3125), (64, 0.28125), (128, 0.265625)):
        sch = KVScheme("int4", "group", group)
        qk, qv = quantize_kv(k, sch), quantize_kv(v, sch)
        held = sum(t.codes.untyped_storage().nbytes() + t.scale.untyped_storage().nbytes() for t in (qk, qv))
        assert held == qk.nbytes() + qv.nbytes()
        # 4 bits per value + one fp32 scale per `group` values, against 16 bits
        assert held / bf16 == want == (0.5 + 4 / group) / 2
    assert (0.5 + 4 / 64) / 2 <= 0.3                   # int4-g64 and coarser meet the 0.3x bound


def test_int4_cache_refuses_odd_head_dim_and_mixed_layouts(rng):
    from lowbit.ops.kv_quant import alloc_tokens, write_tokens
    x = torch.randn(1, 2, 3, 9, generator=rng)
    with pytest.raises(ValueError, match="head_dim 9 is odd.*packed two per byte"):
        quantize_kv(x, KVScheme("int4", "token"))
    q = quantize_kv(torch.randn(1, 2, 3, 8, generator=rng), KVScheme("int4", "group", 4))
    with pytest.raises(ValueError, match="append packed codes to packed"):
        write_tokens(alloc_tokens(q, 6), q.unpacked(), 0)


def test_all_zero_head_is_zero_codes_scale_one(rng):
    x = _states(rng)
    x[:, 1] = 0
    sch = KVScheme("fp8", "head")
    s = static_scale(observe_amax(x, sch), sch)
    assert float(s[0, 1]) == 1.0
    assert int(quantize_kv(x, sch, s).codes[:, 1].abs().sum()) == 0


def test_bad_input_is_refused(rng):
    x = _states(rng)
    sch = KVScheme("fp8", "head")
    with pytest.raises(ValueError, match="NaN/Inf.*batch 1, head 2, token 0"):
        y = x.clone()
        y[1, 2, 0, 5] = float("nan")
        quantize_kv(y, KVScheme("fp8", "token"))
    with pytest.raises(ValueError, match="per-tensor scale where per-head"):
        quantize_kv(x, sch, torch.ones(1, 1, 1, 1))
    with pytest.raises(ValueError, match="static: pass the calibrated scale"):
        quantize_kv(x, sch)
    with pytest.raises(ValueError, match="not a multiple of the KV group size"):
        quantize_kv(x, KVScheme("int4", "group", 16))
    with pytest.raises(ValueError, match="needs a group size"):
        KVScheme.parse("int4")
    from lowbit.ops.kv_quant import KVQuant
    good = quantize_kv(x, KVScheme("fp8", "token"))
    with pytest.raises(ValueError, match="codes must be a 4-D torch.uint8"):
        KVQuant(good.codes.to(torch.int8), good.scale, good.scheme)       # int8 codes under an fp8 scheme
    with pytest.raises(ValueError, match="disagrees with the declared scheme"):
        KVQuant(good.codes, good.scale[:, :1], good.scheme)               # one scale per token was declared
    with pytest.raises(ValueError, match="needs k_scales"):
        KVCacheQuant(KVScheme("fp8"), 2)


def test_ct_args_round_trip():
    for name in ("fp8", "fp8-head", "int8-token", "int4-g32"):
        s = KVScheme.parse(name)
        assert KVScheme.from_ct_args(s.to_ct_args()) == s
    with pytest.raises(ValueError, match="disagrees"):
        KVScheme.from_ct_args({**KVScheme.parse("fp8").to_ct_args(), "dynamic": True})


def _tiny_llama(rng):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, head_dim=24)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    # float64: the cached and the full forward then differ only by float64 summation order, so no
    # float32-boundary code flip can make them disagree
    model = LlamaForCausalLM(cfg).eval().double()
    model.generation_config.eos_token_id = None      # generate exactly max_new_tokens, never stop early
    return model


@pytest.mark.parametrize("name", ["fp8", "int8-head", "fp8-token", "int4-g8"])
def test_generate_equals_uncached_quantized_forward(rng, name):
    model = _tiny_llama(rng)
    ids = torch.randint(0, 61, (2, 7), generator=rng)
    kv = calibrate_kv_cache(model, [torch.randint(0, 61, (2, 12), generator=rng)], name)
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=kv.new_cache(),
                         max_new_tokens=5, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    seq = gen.sequences
    full = model(input_ids=seq[:, :-1], **{cache_kwarg(model): kv.new_cache()}, use_cache=True).logits
    step_logits = torch.stack(gen.logits, dim=1)                   # [B, new, V]
    ref = full[:, ids.shape[1] - 1:]
    # Both runs hold the same codes; they differ by float64 rounding of different summation orders
    # (~ hidden * 2^-53 relative per layer). A code that differed would move logits by a quantization
    # step (>= 2^-9 relative for the finest format here), so 2^-30 of the logits' size separates the two;
    # generate hands its logits back in float32 (one more rounding, 2^-24 relative).
    tol = (2.0 ** -30 + 2.0 ** -24) * float(ref.abs().max())
    assert float((step_logits - ref).abs().max()) <= tol
    assert torch.equal(seq[:, ids.shape[1]:], ref.argmax(-1))


def test_cache_bytes_and_unquantized_differs(rng):
    model = _tiny_llama(rng)
    ids = torch.randint(0, 61, (1, 9), generator=rng)
    kv = calibrate_kv_cache(model, [ids], "fp8")
    cache = kv.new_cache()
    q = model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True).logits
    plain = model(input_ids=ids).logits
    assert cache.get_seq_length() == 9
    # 2 layers x (K, V) x 2 KV heads x 9 tokens x 24 dims, one byte each, plus 2 x 2 x 4 scale bytes
    assert cache.nbytes() == 2 * 2 * 2 * 9 * 24 + 2 * 2 * 4
    assert not torch.equal(q, plain)                               # the cache really is quantized
    assert isinstance(cache, LowbitKVCache) and cache.layers[0].quantized()[0].codes.dtype == torch.uint8


def test_attach_refuses_a_model_without_decoder_attention():
    from lowbit.nn.kv_cache import attach_kv_cache
    with pytest.raises(ValueError, match="no decoder attention modules"):
        attach_kv_cache(torch.nn.Sequential(torch.nn.Linear(4, 4)), KVCacheQuant(KVScheme.parse("fp8-token"), 1))


# ---------------------------------------------------------------- the preallocated buffers
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_SCHEMES = ["fp8", "int8", "fp8-head", "int8-head", "fp8-token", "int8-token"]   # append_kv's
ALL_SCHEMES = KERNEL_SCHEMES + ["int4-g8"]


def _layer(rng, name, x_calib, **kw):
    """A LowbitKVLayer for `name`; static scales from the first tokens of x_calib only, so later
    tokens exceed them (saturated / clamped: the out-of-range writes are compared too)."""
    from lowbit.nn.kv_cache import LowbitKVLayer
    sch = KVScheme.parse(name)
    scales = (None, None) if sch.dynamic else \
        tuple(static_scale(observe_amax(x[:, :, :3], sch), sch).to(DEV) for x in x_calib)
    return LowbitKVLayer(sch, *scales, layer_idx=0, **kw), scales


def _chunks(rng, n):
    """Write sizes summing to n: a prefill of 1..5 tokens, then mostly one-token decode steps with
    a multi-token chunk now and then (speculative / chunked writes)."""
    out = [int(torch.randint(1, 6, (1,), generator=rng))]
    while sum(out) < n:
        big = float(torch.rand(1, generator=rng)) < 0.2
        out.append(int(torch.randint(2, 7, (1,), generator=rng)) if big else 1)
    out[-1] -= sum(out) - n
    return [c for c in out if c > 0]


def _length(rng, lo=37, hi=70):
    n = int(torch.randint(lo, hi, (1,), generator=rng))
    return n + 1 if n & (n - 1) == 0 else n                     # never a power of two


def _grow(layer, k, v, sizes):
    """Write k, v [B, H, T, D] chunk by chunk; returns (last update's outputs, codes data_ptr per write)."""
    at, ptrs, out = 0, [], None
    for c in sizes:
        out = layer.update(k[:, :, at:at + c], v[:, :, at:at + c])
        ptrs.append(layer.quantized()[0].codes.data_ptr())
        at += c
    return out, ptrs


def _assert_same(q, want):
    assert q.codes.shape == want.codes.shape and torch.equal(q.codes.cpu(), want.codes.cpu())
    assert torch.equal(q.scale.cpu(), want.scale.cpu())


WRITE_PATHS = [(n, False) for n in ALL_SCHEMES] + [(n, True) for n in KERNEL_SCHEMES]
PATH_IDS = [f"{n}-{'append_kv' if k else 'quantize_kv'}" for n, k in WRITE_PATHS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, kernel", WRITE_PATHS, ids=PATH_IDS)
def test_grown_cache_equals_one_shot_quantize(rng, name, kernel, dtype):
    n = _length(rng)
    k, v = (_states(rng, B=2, H=3, T=n, D=24).to(DEV, dtype) for _ in range(2))
    layer, (ks, vs) = _layer(rng, name, (k, v), append_kernel=kernel)
    (dk, dv), ptrs = _grow(layer, k, v, _chunks(rng, n))
    assert layer.get_seq_length() == n and layer.capacity >= n
    assert len(set(ptrs)) >= 4                                 # the buffers grew several times on the way
    sch = layer.scheme
    for q, x, s, d in zip(layer.quantized(), (k, v), (ks, vs), (dk, dv)):
        want = quantize_kv(x, sch, s)
        _assert_same(q, want)
        assert torch.equal(d, want.dequantize(dtype))           # update returns the filled tokens dequantized


@pytest.mark.parametrize("name, kernel", [("fp8-head", False), ("int8-token", False), ("int4-g8", False),
                                          ("fp8-head", True), ("int8-token", True)],
                         ids=["fp8-head", "int8-token", "int4-g8", "fp8-head-append_kv", "int8-token-append_kv"])
def test_crop_reorder_and_batch_ops_after_growth(rng, name, kernel):
    n, B = _length(rng, 20, 40), 3
    k, v = (_states(rng, B=B, H=3, T=n + 12, D=24).to(DEV) for _ in range(2))
    layer, (ks, vs) = _layer(rng, name, (k, v), append_kernel=kernel)
    _grow(layer, k[:, :, :n], v[:, :, :n], [1] * n)
    sch = layer.scheme

    # crop: the kept tokens stay, the next writes land after them
    cut = int(torch.randint(1, n - 2, (1,), generator=rng))
    layer.crop(-cut)
    assert layer.get_seq_length() == n - cut
    ptr, cap = layer.quantized()[0].codes.data_ptr(), layer.capacity
    _grow(layer, k[:, :, n:n + 4], v[:, :, n:n + 4], [1, 2, 1])
    kk = torch.cat([k[:, :, :n - cut], k[:, :, n:n + 4]], dim=2)
    vv = torch.cat([v[:, :, :n - cut], v[:, :, n:n + 4]], dim=2)
    for q, x, s in zip(layer.quantized(), (kk, vv), (ks, vs)):
        _assert_same(q, quantize_kv(x, sch, s))
    # written in place while the capacity holds them (a cut of 1..3 tokens just under a power of two
    # does not: then the buffers grow once)
    assert (layer.quantized()[0].codes.data_ptr() == ptr) == (n - cut + 4 <= cap)
    ptr = layer.quantized()[0].codes.data_ptr()

    # beam reorder (with a repeated row): in place, then more tokens
    beam = torch.randint(0, B, (B,), generator=rng)
    layer.reorder_cache(beam)
    assert layer.quantized()[0].codes.data_ptr() == ptr
    _grow(layer, k[:, :, n + 4:n + 6], v[:, :, n + 4:n + 6], [1, 1])
    kk = torch.cat([kk[beam.to(DEV)], k[:, :, n + 4:n + 6]], dim=2)
    vv = torch.cat([vv[beam.to(DEV)], v[:, :, n + 4:n + 6]], dim=2)
    for q, x, s in zip(layer.quantized(), (kk, vv), (ks, vs)):
        _assert_same(q, quantize_kv(x, sch, s))

    # batch select, then repeat (generate's expansion for num_return_sequences), then more tokens
    keep = torch.tensor([2, 0])
    layer.batch_select_indices(keep)
    layer.batch_repeat_interleave(2)
    rows = keep.repeat_interleave(2)
    new_k, new_v = k[rows.to(DEV), :, n + 6:n + 8], v[rows.to(DEV), :, n + 6:n + 8]
    _grow(layer, new_k, new_v, [1, 1])
    kk = torch.cat([kk[rows.to(DEV)], new_k], dim=2)
    vv = torch.cat([vv[rows.to(DEV)], new_v], dim=2)
    for q, x, s in zip(layer.quantized(), (kk, vv), (ks, vs)):
        _assert_same(q, quantize_kv(x, sch, s))


@pytest.mark.parametrize("name", ["fp8", "int4-g8"])
def test_buffers_grow_by_doubling_not_every_step(rng, name):
    n = _length(rng, 40, 90)
    k, v = (_states(rng, T=n).to(DEV) for _ in range(2))
    layer, _ = _layer(rng, name, (k, v))
    caps, ptrs = [], []
    for t in range(n):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        caps.append(layer.capacity)
        ptrs.append((layer._k.codes.data_ptr(), layer._v.codes.data_ptr()))
    # one token at a time from empty: capacities 1, 2, 4, ... up to the power of two above n (not
    # one itself), and the buffers move only when the capacity changes
    assert sorted(set(caps)) == [2 ** i for i in range(n.bit_length() + 1)]
    for t in range(1, n):
        assert (ptrs[t] == ptrs[t - 1]) == (caps[t] == caps[t - 1])
    assert layer.capacity_nbytes() >= layer.nbytes()
    # nbytes counts the filled tokens as a contiguous cache stores them; capacity_nbytes the buffers
    q = quantize_kv(k, layer.scheme, layer._k.scale if not layer.scheme.dynamic else None)
    assert layer.nbytes() == 2 * q.nbytes()
    per_token = q.nbytes() // n if layer.scheme.dynamic else (q.codes.numel() * q.codes.element_size()) // n
    assert layer.capacity_nbytes() - layer.nbytes() == 2 * per_token * (layer.capacity - n)


@pytest.mark.parametrize("kernel", [False, True], ids=["quantize_kv", "append_kv"])
def test_max_cache_len_preallocates_and_refuses_more(rng, kernel):
    from lowbit.nn.kv_cache import LowbitKVLayer
    cap = _length(rng, 10, 30)
    k, v = (_states(rng, T=cap + 3).to(DEV) for _ in range(2))
    layer, _ = _layer(rng, "fp8-token", (k, v), max_cache_len=cap, append_kernel=kernel)
    (dk, _), ptrs = _grow(layer, k[:, :, :cap], v[:, :, :cap], _chunks(rng, cap))
    assert len(set(ptrs)) == 1 and layer.capacity == cap        # allocated once, at the first write
    for extra in (k[:, :, cap:cap + 1], k[:, :, cap:cap + 3]):  # a decode step, a chunk
        with pytest.raises(ValueError, match=f"max_cache_len={cap}.*larger max_cache_len"):
            layer.update(extra, extra)
        assert layer.get_seq_length() == cap                    # nothing written
    _assert_same(layer.quantized()[0], quantize_kv(k[:, :, :cap], layer.scheme))
    fresh, _ = _layer(rng, "fp8-token", (k, v), max_cache_len=cap)
    with pytest.raises(ValueError, match="max_cache_len"):      # a prefill longer than the cache
        fresh.update(k, v)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
            LowbitKVLayer(KVScheme.parse("fp8-token"), max_cache_len=bad)


def test_reset_reuses_buffers_and_refits_another_batch(rng):
    k, v = (_states(rng, T=9).to(DEV) for _ in range(2))
    layer, _ = _layer(rng, "int8-token", (k, v))
    _grow(layer, k, v, [4, 1, 1, 3])
    ptr, cap = layer._k.codes.data_ptr(), layer.capacity
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0
    with pytest.raises(ValueError, match="empty"):
        layer.quantized()
    layer.update(k[:, :, :5], v[:, :, :5])                       # same batch: the old buffers
    assert layer._k.codes.data_ptr() == ptr and layer.capacity == cap
    _assert_same(layer.quantized()[0], quantize_kv(k[:, :, :5], layer.scheme))
    layer.reset()
    k3 = _states(rng, B=3, T=4).to(DEV)                          # another batch size: new buffers
    layer.update(k3, k3)
    _assert_same(layer.quantized()[1], quantize_kv(k3, layer.scheme))
    with pytest.raises(ValueError, match="batch, KV heads and head_dim must agree"):
        layer.update(k[:, :, :1], v[:, :, :1])                 # a batch of 2 into a cache of 3


def test_nan_state_refused_at_once_on_the_quantize_kv_path(rng):
    k, v = (_states(rng, T=6) for _ in range(2))
    layer, _ = _layer(rng, "fp8-token", (k, v), append_kernel=False)
    layer.update(k[:, :, :5], v[:, :, :5])
    bad = v[:, :, 5:6].clone()
    bad[1, 2, 0, 7] = float("nan")
    with pytest.raises(ValueError, match="layer 0 value states holds 1 NaN/Inf.*batch 1, head 2"):
        layer.update(k[:, :, 5:6], bad)
    assert layer.get_seq_length() == 5


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")    # the interpreter's numpy on Inf
def test_nan_state_on_the_append_kv_path_is_raised_at_the_next_update(rng):
    k, v = (_states(rng, T=9).to(DEV) for _ in range(2))
    layer, _ = _layer(rng, "int8-token", (k, v), append_kernel=True)
    layer.update(k[:, :, :5], v[:, :, :5])
    layer.update(k[:, :, 5:6], v[:, :, 5:6])
    bad = k[:, :, 6:7].clone()
    b, h = int(torch.randint(0, 2, (1,), generator=rng)), int(torch.randint(0, 3, (1,), generator=rng))
    bad[b, h, 0, 3] = float("inf")
    layer.update(bad, v[:, :, 6:7])                               # written by the kernel, recorded on the device
    msg = f"layer 0 key states held NaN/Inf.*batch {b}, head {h}, token 6"
    with pytest.raises(ValueError, match=msg):
        layer.check_finite()
    if DEV == "cuda":
        torch.cuda.synchronize()                                  # the record's copy to pinned memory has landed
    with pytest.raises(ValueError, match=msg):
        layer.update(k[:, :, 7:8], v[:, :, 7:8])
    layer.crop(-1)                                                # drop the bad token: the record goes with it
    layer.check_finite()
    layer.update(k[:, :, 7:8], v[:, :, 7:8])
    kk = torch.cat([k[:, :, :6], k[:, :, 7:8]], dim=2)
    _assert_same(layer.quantized()[0], quantize_kv(kk, layer.scheme))


@pytest.mark.parametrize("name", ["fp8", "int8-token"])
def test_generate_with_append_kv_holds_the_quantize_kv_codes(rng, name):
    # float32 (append_kv takes 16/32-bit states): the two write paths must give the same codes, so
    # the two generations compute the same values in the same order and agree exactly
    model = _tiny_llama(rng).float().to(DEV)        # the kernel path needs the model where Triton runs
    ids = torch.randint(0, 61, (2, 6), generator=rng).to(DEV)
    kv = calibrate_kv_cache(model, [torch.randint(0, 61, (2, 12), generator=rng).to(DEV)], name)
    runs = []
    for kernel, cap in ((False, None), (True, None), (True, 40)):
        cache = kv.new_cache(max_cache_len=cap, append_kernel=kernel)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=9,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        runs.append((gen, cache))
    (g0, c0) = runs[0]
    for g, c in runs[1:]:
        assert torch.equal(g.sequences, g0.sequences)
        assert all(torch.equal(a, b) for a, b in zip(g.logits, g0.logits))
        for la, lb in zip(c.layers, c0.layers):
            for qa, qb in zip(la.quantized(), lb.quantized()):
                _assert_same(qa, qb)
    assert runs[2][1].layers[0].capacity == 40 and runs[2][1].nbytes() == c0.nbytes()
