"""compressed-tensors checkpoints, checked with the real compressed-tensors and transformers.

Oracles: compressed-tensors' own compressors decompress lowbit's tensors (they must give
lowbit's dequantized weights bit for bit), compressed-tensors' format inference and
argument validation, and transformers.from_pretrained on the saved directory.
"""
import json
import os

import pytest
import torch

from lowbit.io import ct_layout as L
from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.io.st_format import CheckpointError
from lowbit.recipes.presets import RECIPES
from lowbit.quantize import quantize
from lowbit.scheme import QuantScheme

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.format import infer_module_format  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

U32 = 2.0 ** -24  # fp32 unit roundoff
UBF16 = 2.0 ** -8  # bf16 unit roundoff

# Weight schemes beyond the recipes that compressed-tensors can also hold.
EXTRA = {
    "int8-channel-asym": (QuantScheme("int8", "channel", symmetric=False), None),
    "int8-group64": (QuantScheme("int8", "group", group_size=64), None),
    "fp8-tensor": (QuantScheme("fp8_e4m3fn", "tensor"), None),
    "fp8-block": (QuantScheme("fp8_e4m3fn", "block", block_size=(16, 64)),
                  QuantScheme("fp8_e4m3fn", "token", dynamic=True)),
    "int4-channel-asym": (QuantScheme("int4", "channel", symmetric=False), None),
}
PAIRS = {**{n: (r.weight, r.act) for n, r in RECIPES.items()}, **EXTRA}


def ct_scheme(w, a):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**L.scheme_to_args(w)),
                              input_activations=None if a is None else QuantizationArgs(**L.scheme_to_args(a)))


def random_weight(rng, n=40, k=384):
    """[n, k] weight with N not a multiple of any tile, varied row scales, an outlier and an
    all-zero row (zero groups get scale 1.0)."""
    w = torch.randn(n, k, generator=rng) * torch.rand(n, 1, generator=rng).add(0.05)
    w[3, 7] = 25.0
    w[5] = 0.0
    return w


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_scheme_args_and_format_agree_with_compressed_tensors(name):
    w, a = PAIRS[name]
    args = L.scheme_to_args(w)
    QuantizationArgs(**args)  # compressed-tensors' own validation accepts what lowbit writes
    back = L.args_to_scheme(args)
    assert back == w
    fmt = L.ct_format(w, a)
    assert fmt == infer_module_format(torch.nn.Linear, ct_scheme(w, a)).value
    if name in RECIPES:
        assert RECIPES[name].ct_format == fmt


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_ct_decompression_is_bit_identical(name, rng):
    w_s, a_s = PAIRS[name]
    w = random_weight(rng)
    if w_s.two_level:
        # Make the tensor scale g = amax / (448 * 6) a power of two (2^-8), so that
        # compressed-tensors' division by its stored 1/g is exact; the general case is
        # test_nvfp4_global_scale_reciprocal below.
        w = w / w.abs().max() * (2688.0 * 2.0 ** -8)
    qt = quantize(w, w_s)
    fmt = L.ct_format(w_s, a_s)
    tensors = L.qtensor_to_ct(qt, fmt)
    dense = BaseCompressor.get_value_from_registry(fmt).decompress(dict(tensors), ct_scheme(w_s, a_s))["weight"]
    if w_s.format == "fp4_e2m1fn" or w_s.scale_format == "e8m0":
        # compressed-tensors returns these in bfloat16. MX values (element * 2^k) are exact
        # in bf16, so the fp32 dequantization must equal it; NVFP4's product is rounded.
        assert dense.dtype == torch.bfloat16
        if w_s.scale_format == "e8m0":
            assert torch.equal(dense.float(), qt.dequantize(torch.float32))
        assert torch.equal(dense, qt.dequantize(torch.bfloat16))
    else:
        assert dense.dtype == torch.float32
        assert torch.equal(dense, qt.dequantize(torch.float32))
    back = L.ct_to_qtensor(tensors, w_s, fmt, global_scale=qt.global_scale)
    assert torch.equal(back.codes, qt.codes) and torch.equal(back.scale, qt.scale)
    assert (back.zero_point is None) == (qt.zero_point is None)
    if qt.zero_point is not None:
        assert torch.equal(back.zero_point, qt.zero_point)


def test_nvfp4_global_scale_reciprocal(rng):
    """compressed-tensors stores G = fp32(1/g) and computes block_scale / G; lowbit computes
    fp32(block_scale * g). With G = (1/g)(1 + d), |d| <= u, the two effective scales are
    correctly rounded values of quantities within a relative u of each other, so they
    differ by at most one fp32 ulp (relative 2u); most are equal."""
    w = random_weight(rng, 24, 128)
    scheme = RECIPES["nvfp4"].weight
    qt = quantize(w, scheme)
    t = L.qtensor_to_ct(qt, "nvfp4-pack-quantized")
    from lowbit.formats import decode
    ct_scale = decode(qt.scale_codes, "fp8_e4m3fn") / t["weight_global_scale"]
    rel = ((ct_scale - qt.scale).abs() / qt.scale).max().item()
    assert rel <= 2 * U32
    # Without lowbit's record, the reader falls back to 1/G: again within one ulp.
    back = L.ct_to_qtensor(t, scheme, "nvfp4-pack-quantized")
    assert torch.equal(back.codes, qt.codes)
    assert ((back.global_scale - qt.global_scale).abs() / qt.global_scale).item() <= 2 * U32


def test_int32_packing_matches_compressed_tensors(rng):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    for bits in (2, 4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        codes = torch.randint(lo, hi + 1, (7, 37), generator=rng, dtype=torch.int8)
        for dim in (0, 1):
            mine = L.pack_int32(codes, bits, dim=dim)
            assert torch.equal(mine, pack_to_int32(codes, bits, packed_dim=dim))
            n = codes.shape[dim]
            assert torch.equal(L.unpack_int32(mine, bits, n, dim=dim), codes)
            assert torch.equal(unpack_from_int32(mine, bits, codes.shape, packed_dim=dim), codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="packing where the codes are: the GPU")
def test_int32_packing_on_the_gpu_is_the_host_packing(rng):
    # lowbit.pipelines.layerwise packs GPTQ's W4A16 codes on the device (QuantLinear(host_twin=False))
    for bits in (2, 4, 8):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        codes = torch.randint(lo, hi + 1, (300, 263), generator=rng, dtype=torch.int8)
        for dim in (0, 1):
            assert torch.equal(L.pack_int32(codes.cuda(), bits, dim=dim).cpu(), L.pack_int32(codes, bits, dim=dim))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 4-bit host twin exists on the GPU only")
def test_w4a16_tensors_without_the_host_twin_are_the_same(rng):
    from lowbit.pipelines.checkpoint import describe_qlayer, expand_deferred, module_tensors
    from lowbit.nn.quant_linear import QuantLinear
    scheme = RECIPES["w4a16"].weight
    w = torch.randn(96, 512, generator=rng).to(torch.bfloat16).cuda()
    qt = quantize(w.float(), scheme)
    a = QuantLinear(qt, scheme, None)                   # the exact twin on the host
    b = QuantLinear(qt, scheme, None, host_twin=False)  # left on the device
    assert a.weight_q.codes.device.type == "cpu" and b.weight_q.codes.device.type == "cuda"
    got = []
    for m in (a, b):
        fmt = {"": describe_qlayer("x", m)[0]}
        got.append({n: t.cpu() for n, t in expand_deferred(module_tensors(m, fmt, set(), "", defer_host=True))})
    assert sorted(got[0]) == sorted(got[1])
    for n in got[0]:
        assert got[0][n].dtype == got[1][n].dtype and torch.equal(got[0][n], got[1][n]), n


# ------------------------------------------------------------------ whole checkpoints
def tiny_llama(seed_gen, tie=False):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=seed_gen)))
    return transformers.LlamaForCausalLM(cfg).float().eval()


def quantized_llama(rng, recipe, **kw):
    from lowbit.pipelines.quantize_model import quantize_model
    model = tiny_llama(rng, **kw)
    quantize_model(model, recipe)
    return model


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w4a16-asym", "mxfp4", "nvfp4"])
def test_lowbit_reloads_its_checkpoint_exactly(recipe, rng, tmp_path):
    model = quantized_llama(rng, recipe)
    # A small shard size forces several files and an index.
    out = save_compressed(model, tmp_path / "ckpt", recipe, max_shard_bytes=200_000)
    assert os.path.exists(out / "model.safetensors.index.json")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left
    ck = load_compressed(out)
    assert ck.recipe == recipe
    qmods = {n: m for n, m in model.named_modules() if hasattr(m, "weight_q")}
    assert set(ck.qtensors) == set(qmods)
    for n, m in qmods.items():
        a, b = ck.qtensors[n], m.weight_q
        assert a.scheme == b.scheme and tuple(a.shape) == tuple(b.shape)
        for f in ("codes", "scale", "zero_point", "scale_codes", "global_scale"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None), f
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y), (n, f)
        assert ck.act_schemes[n] == m.act_scheme
    sd = {k: v for k, v in model.state_dict().items() if "weight_q" not in k}
    for k, v in sd.items():
        if k in ck.tensors:
            assert torch.equal(ck.tensors[k], v), k
    ids = torch.randint(0, 96, (2, 9), generator=rng)
    with torch.no_grad():
        # Same codes, same scales, same code path: the logits must be identical.
        assert torch.equal(ck.to_model()(ids).logits, model(ids).logits)


def _max_k(model):
    return max(m.in_features for m in model.modules() if hasattr(m, "in_features"))


def _depth(model):
    # Matmuls on the longest path to the logits: 7 per decoder layer (q/k/v share a level,
    # QK^T, PV, o_proj, gate|up, down ~ counted generously as 7) plus lm_head.
    return 7 * model.config.num_hidden_layers + 1


# Two ways transformers loads a compressed-tensors checkpoint:
# "compressed": the default; compressed-tensors builds compressed modules, loads the tensors
#   into them and decompresses on the first forward. Activations are then fake-quantized on
#   the CPU: for fp8 compressed-tensors' scale (amax / 448) and cast are lowbit's, so they stay
#   on; for int8 it divides by 127.5 where lowbit (and vLLM) divide by 127, and MX/NVFP4
#   activation quantization is the consumer's run-time choice, so those run unquantized on
#   both sides. Asymmetric pack-quantized is left out of this mode: compressed-tensors 0.20
#   sizes the packed zero point of its meta-device skeleton unpacked ([N, G] instead of
#   [N/8, G]) and transformers 5.24 then refuses the checkpoint -- its own checkpoints too
#   (compressors/pack_quantized/base.py, the meta branch of compress).
# "dequantize": CompressedTensorsConfig(dequantize=True) dequantizes every weight at load
#   time into a plain dense model (no activation quantization).
LOGIT_CASES = [(r, "compressed") for r in ("w8a16-int8", "w4a16", "w8a8-fp8", "w8a8-int8", "mxfp8", "mxfp4",
                                           "nvfp4")]
LOGIT_CASES += [(r, "dequantize") for r in ("w4a16-asym", "w8a8-int8", "mxfp4")]
ACTS_ON = {("w8a8-fp8", "compressed")}


def load_with_transformers(path, mode):
    kw = {}
    if mode == "dequantize":
        qc = json.loads((path / "config.json").read_text())["quantization_config"]
        kw["quantization_config"] = transformers.CompressedTensorsConfig(
            dequantize=True, **{k: v for k, v in qc.items() if k != "quant_method"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    if mode == "compressed":
        hf.hf_quantizer.compressor.decompress_model(hf)
    return hf


@pytest.mark.parametrize("recipe,mode", LOGIT_CASES)
def test_transformers_loads_checkpoint_and_logits_match(recipe, mode, rng, tmp_path):
    model = quantized_llama(rng, recipe)
    out = save_compressed(model, tmp_path / "ckpt", recipe)
    acts_on = (recipe, mode) in ACTS_ON
    if not acts_on:
        for m in model.modules():
            if hasattr(m, "act_scheme"):
                m.act_scheme = None
    hf = load_with_transformers(out, mode)
    for name, m in model.named_modules():
        if hasattr(m, "weight_q"):
            hm = hf.get_submodule(name)
            if mode == "compressed":  # the scheme compressed-tensors attached is the one lowbit meant
                assert hm.quantization_scheme.weights.num_bits == m.weight_scheme.num_bits
                assert (hm.quantization_scheme.input_activations is None) == (RECIPES[recipe].act is None)
                hm.quantization_enabled = acts_on
            # Decompressed weights: bit-identical (fp32-scale schemes and MX, exact in bf16) or
            # compressed-tensors' bf16 rounding of the product (NVFP4).
            assert torch.equal(hm.weight.data, m.weight_q.dequantize(hm.weight.dtype)), name
            hm.weight.data = hm.weight.data.float()
    assert type(hf.get_submodule("lm_head")) is torch.nn.Linear
    ids = torch.randint(0, 96, (2, 11), generator=rng)
    with torch.no_grad():
        ref = model(ids).logits
        got = hf(ids).logits
    # Both are float32 forwards of the same dequantized weights (and, for fp8, the same
    # activation codes), differing only in summation order: each length-K dot product is
    # within K*u*sum|x w| of exact (Higham's gamma_K), and the error passes through at most
    # `depth` matmuls, so the two sets of logits agree within 2 * depth * K * u * max|logits|.
    # NVFP4 weights are rounded to bf16 by compressed-tensors' decompression (relative u_bf16
    # per weight), which replaces u there.
    u = UBF16 if recipe == "nvfp4" else U32
    tol = 2 * _depth(model) * _max_k(model) * u * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol


def test_tied_embeddings_are_stored_once(rng, tmp_path):
    model = quantized_llama(rng, "w8a16-int8", tie=True)
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8")
    ck = load_compressed(out)
    assert "lm_head.weight" not in ck.tensors and "model.embed_tokens.weight" in ck.tensors
    ids = torch.randint(0, 96, (1, 7), generator=rng)
    with torch.no_grad():
        assert torch.equal(ck.to_model()(ids).logits, model(ids).logits)


def test_mixed_recipes_give_groups_by_name(rng, tmp_path):
    from lowbit.pipelines.quantize_model import quantize_model
    model = tiny_llama(rng)
    quantize_model(model, "w8a8-int8", overrides={"model.layers.*.mlp.down_proj": "w8a8-fp8"})
    out = save_compressed(model, tmp_path / "ckpt")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and len(qc["config_groups"]) == 2
    targets = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert targets["float-quantized"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    ck = load_compressed(out)
    assert ck.qtensors["model.layers.1.mlp.down_proj"].scheme.format == "fp8_e4m3fn"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    hf.hf_quantizer.compressor.decompress_model(hf)
    w = hf.get_submodule("model.layers.1.mlp.down_proj").weight
    assert torch.equal(w, model.get_submodule("model.layers.1.mlp.down_proj").weight_q.dequantize())


# ------------------------------------------------------------------ bad input
@pytest.fixture
def saved(rng, tmp_path):
    model = quantized_llama(rng, "w4a16")
    return save_compressed(model, tmp_path / "ckpt", "w4a16", max_shard_bytes=150_000)


def _edit_config(path, fn):
    p = path / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def test_missing_or_wrong_quantization_config(saved):
    _edit_config(saved, lambda c: c["quantization_config"].update(quant_method="gptq"))
    with pytest.raises(CheckpointError, match="quant_method"):
        load_compressed(saved)
    _edit_config(saved, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_compressed(saved)
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_compressed(saved)


def test_inconsistent_metadata(saved):
    # config.json and lowbit.json disagree on the group size
    _edit_config(saved, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=64))
    with pytest.raises(CheckpointError, match="config.json says"):
        load_compressed(saved)
    (saved / "lowbit.json").unlink()  # without lowbit's record the scale shapes give it away
    with pytest.raises(CheckpointError, match="weight_scale has shape"):
        load_compressed(saved)


def test_truncated_and_missing_shards(saved):
    shards = sorted(p for p in os.listdir(saved) if p.endswith(".safetensors"))
    assert len(shards) > 1
    victim = saved / shards[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_compressed(saved)
    victim.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_compressed(saved)


def test_failed_save_leaves_nothing(rng, tmp_path):
    from lowbit.nn.quant_linear import QuantLinear
    model = tiny_llama(rng)
    lin = model.model.layers[0].mlp.up_proj
    e5 = QuantScheme("fp8_e5m2", "channel")  # no compressed-tensors encoding
    model.model.layers[0].mlp.up_proj = QuantLinear.from_linear(lin, e5, None)
    with pytest.raises(L.UnsupportedScheme, match="fp8_e5m2"):
        save_compressed(model, tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_compressed(tiny_llama(rng), tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        save_compressed(quantized_llama(rng, "w8a16-int8"), tmp_path / "full")


@pytest.mark.parametrize("recipe", ["w8a8-fp8", "w8a8-int8"])
def test_static_activation_scales_round_trip(recipe, rng, tmp_path):
    """Calibrated per-tensor activation scales are stored as input_scale [1] and come back
    bit for bit; with fp8 compressed-tensors' static fake-quant (x / s, clamp to 448, cast)
    is lowbit's, so transformers' logits match with activations quantized on both sides."""
    from lowbit.algorithms.static_scales import calibrate_static_scales
    from lowbit.pipelines.quantize_model import quantize_model
    model = tiny_llama(rng)
    ids = torch.randint(0, 96, (2, 11), generator=rng)
    scales = calibrate_static_scales(model, [ids], RECIPES[recipe].act)
    quantize_model(model, recipe, act_static_scales=scales)
    out = save_compressed(model, tmp_path / "ckpt", recipe)
    ck = load_compressed(out)
    assert set(ck.act_static_scales) == {n for n, m in model.named_modules() if hasattr(m, "weight_q")}
    for n in ck.act_static_scales:
        s = scales[n]
        assert torch.equal(ck.act_static_scales[n], s.reshape(1, 1).float())
        assert ck.act_schemes[n].strategy == "tensor" and not ck.act_schemes[n].dynamic
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(ck.to_model()(ids).logits, ref)
    if recipe != "w8a8-fp8":
        return  # int8: compressed-tensors clamps to -128 where lowbit clamps to -127
    hf = load_with_transformers(out, "compressed")
    for name, m in model.named_modules():
        if hasattr(m, "weight_q"):
            hm = hf.get_submodule(name)
            assert hm.quantization_scheme.input_activations.dynamic is False
            assert torch.equal(hm.input_scale.data.reshape(1, 1), m.act_static_scale)
    with torch.no_grad():
        got = hf(ids).logits
    tol = 2 * _depth(model) * _max_k(model) * U32 * ref.abs().max().item()  # as in the test above
    assert (got - ref).abs().max().item() <= tol


def test_overwrite_replaces_only_lowbits_files(rng, tmp_path):
    """overwrite=True replaces a previous lowbit checkpoint's files (its old shards included) and
    nothing else: a user's file stays, and a foreign *.safetensors (which a loader would mix into
    the checkpoint) is refused before anything is written."""
    from lowbit.io.outdir import MANIFEST, OutputDirError
    model = quantized_llama(rng, "w8a16-int8")
    out = save_compressed(model, tmp_path / "ckpt", "w8a16-int8", max_shard_bytes=1 << 14)
    old_shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(old_shards) > 1
    (out / "notes.txt").write_text("mine")
    save_compressed(model, out, "w8a16-int8", overwrite=True)
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine" and (out / MANIFEST).exists()
    assert load_compressed(out).recipe == "w8a16-int8"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]    # no staging or backup directory left

    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "stale.safetensors").write_bytes(b"old")
    with pytest.raises(OutputDirError, match="stale.safetensors"):
        save_compressed(model, tmp_path / "user", "w8a16-int8", overwrite=True)
    assert os.listdir(tmp_path / "user") == ["stale.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "user"]


def test_reads_checkpoints_of_other_tools(rng, tmp_path):
    """Without lowbit.json the schemes come from quantization_config alone; bf16 scales (as
    llm-compressor writes them) are widened to float32 exactly."""
    from safetensors.torch import load_file, save_file
    model = quantized_llama(rng, "w8a8-int8")
    out = save_compressed(model, tmp_path / "ckpt", "w8a8-int8")
    (out / "lowbit.json").unlink()
    t = load_file(out / "model.safetensors")
    for k in [k for k in t if k.endswith("weight_scale")]:
        t[k] = t[k].bfloat16()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    ck = load_compressed(out)
    assert ck.recipe is None
    for n, m in model.named_modules():
        if hasattr(m, "weight_q"):
            got = ck.qtensors[n]
            assert got.scheme == m.weight_scheme and torch.equal(got.codes, m.weight_q.codes)
            assert got.scale.dtype == torch.float32
            assert torch.equal(got.scale, m.weight_q.scale.bfloat16().float())
