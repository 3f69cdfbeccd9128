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
