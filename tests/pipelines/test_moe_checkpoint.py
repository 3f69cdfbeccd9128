"""MoE experts in compressed-tensors checkpoints: per-expert tensors under the names vLLM's
fused-MoE loader reads, written from the QuantExperts codes and scales unchanged.

Oracles: the names are spelled here from vLLM's rule (FusedMoE.make_expert_params_mapping maps
``<block>.experts.<e>.<gate|up|down>.<tensor>`` to ``w13_<tensor>`` / ``w2_<tensor>``; the model
files name gate/up/down w1/w3/w2 under ``block_sparse_moe`` for Mixtral and gate_proj/up_proj/
down_proj under ``mlp`` for Qwen2/3-MoE, OLMoE and DeepSeek-V3), and every other name must be the
one transformers' own save_pretrained writes; compressed-tensors' compressors decompress each
expert's tensors; transformers 5 loads the directory with CompressedTensorsConfig(dequantize=True),
merging the per-expert tensors into its fused parameters with its own conversion mapping."""
import copy
import json
import re

import pytest
import torch

from lowbit.io import ct_layout as L
from lowbit.io.st_format import CheckpointError, TensorReader, checkpoint_files
from lowbit.nn.experts import QuantExperts
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines.checkpoint import load_compressed, save_compressed
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.recipes.presets import RECIPES
from family_fixtures import logits_gate
from moe_fixtures import ids, tiny_moe

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402

SAVABLE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# vLLM's per-family checkpoint names: (block attribute, gate, up, down)
VLLM_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
VLLM_NAMES.update({f: ("mlp", "gate_proj", "up_proj", "down_proj") for f in SAVABLE if f != "mixtral"})
RECIPES_ALL = ("w8a8-int8", "w8a16-int8", "w4a16", "w4a16-asym", "w4a16-g32", "w8a8-fp8", "mxfp8", "mxfp4", "nvfp4")
WIDE = {"w4a16", "w4a16-asym"}          # groups of 128 need H and I of 128


def _model(family, recipe, rng, experts=4, **kw):
    m = tiny_moe(family, rng, dtype=torch.float32, experts=experts, width=128 if recipe in WIDE else 64)
    if recipe in WIDE:      # attention Linears with K = heads * head_dim = 64 stay float under groups of 128
        kw["ignore"] = [n for n, x in m.named_modules() if isinstance(x, torch.nn.Linear) and x.in_features % 128]
    quantize_model(m, recipe, **kw)
    return m


def _moe_layers(family):
    return [1] if family == "deepseek_v3" else [0, 1]    # DeepSeek-V3's first layer is dense here


def _keys(d):
    return set(checkpoint_files(d))


def _tensors(d, names):
    files = checkpoint_files(d)
    out = {}
    for n in names:
        with TensorReader(files[n]) as r:
            out[n] = r.get(n)
    return out


@pytest.mark.parametrize("family", SAVABLE)
def test_names_are_vllms_and_the_rest_transformers(family, rng, tmp_path):
    m = tiny_moe(family, rng, dtype=torch.float32, experts=4)
    hf_dir = tmp_path / "hf"
    m.save_pretrained(hf_dir)                       # transformers' own names for the float model
    hf_names = _keys(hf_dir)
    quantize_model(m, "w8a8-int8")
    out = save_compressed(m, tmp_path / "ck", "w8a8-int8")
    names = _keys(out)
    block, *projs = VLLM_NAMES[family]
    want = {f"model.layers.{i}.{block}.experts.{e}.{p}.{t}" for i in _moe_layers(family) for e in range(4)
            for p in projs for t in ("weight", "weight_scale")}
    assert want <= names
    assert not [n for n in names if n.endswith(("gate_up_proj", "down_proj", "_codes", "_scale_codes"))]
    # every quantized Linear (experts included) in int-quantized's two tensors, the rest as transformers names them
    quantized = {n[: -len(".weight_scale")] for n in names if n.endswith(".weight_scale")}
    expected = {n for n in hf_names if n[: -len(".weight")] not in quantized} | \
        {f"{q}.{t}" for q in quantized for t in ("weight", "weight_scale")}
    assert names == expected
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in qc["config_groups"].values()] == [["Linear"]]
    router = "gate"
    assert {f"model.layers.{i}.{block}.{router}" for i in _moe_layers(family)} <= set(qc["ignore"])
    assert "lm_head" in qc["ignore"]
    side = json.loads((out / "lowbit.json").read_text())["layers"]
    assert set(side) == quantized


def _assert_same_qtensor(a, b, where):
    assert a.scheme == b.scheme and tuple(a.shape) == tuple(b.shape), where
    for f in ("codes", "scale", "zero_point", "scale_codes", "global_scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), (where, f)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), (where, f)


CASES = [("qwen3_moe", r) for r in RECIPES_ALL] + [("mixtral", r) for r in ("w8a8-int8", "w4a16-g32", "nvfp4")]
CASES += [(f, "w8a16-int8") for f in ("qwen2_moe", "olmoe", "deepseek_v3")]


@pytest.mark.parametrize("family,recipe", CASES)
def test_lowbit_reloads_experts_exactly(family, recipe, rng, tmp_path):
    m = _model(family, recipe, rng)
    out = save_compressed(m, tmp_path / "ck", recipe, max_shard_bytes=150_000)
    back = load_compressed(out).to_model()
    qe = {n: x for n, x in m.named_modules() if isinstance(x, QuantExperts)}
    assert qe and set(qe) == {n for n, x in back.named_modules() if isinstance(x, QuantExperts)}
    for n, a in qe.items():
        b = back.get_submodule(n)
        assert (b.act_scheme, b.family, b.num_experts) == (a.act_scheme, a.family, a.num_experts)
        for p in ("gate_up", "down"):
            for e in range(a.num_experts):
                _assert_same_qtensor(b.weight_q(p, e), a.weight_q(p, e), f"{n} {p} {e}")
    assert {n for n, x in m.named_modules() if isinstance(x, QuantLinear)} == \
        {n for n, x in back.named_modules() if isinstance(x, QuantLinear)}
    x = ids(rng, 9)
    with torch.no_grad():      # same codes, scales and code path: identical logits
        assert torch.equal(back(x).logits, m(x).logits)


def _ct_scheme(w, a):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**L.scheme_to_args(w)),
                              input_activations=None if a is None else QuantizationArgs(**L.scheme_to_args(a)))


@pytest.mark.parametrize("recipe", RECIPES_ALL)
def test_compressed_tensors_decompresses_each_expert_exactly(recipe, rng, tmp_path):
    """compressed-tensors' own compressor on each expert's stored tensors gives lowbit's
    dequantized rows: bit-identical (fp32 scales; MX values are exact in bf16), NVFP4 within
    compressed-tensors' own roundings."""
    m = _model("qwen3_moe", recipe, rng)
    out = save_compressed(m, tmp_path / "ck", recipe)
    r = RECIPES[recipe]
    comp = BaseCompressor.get_value_from_registry(r.ct_format)
    names = _keys(out)
    qe = m.get_submodule("model.layers.1.mlp.experts")
    # compressed-tensors multiplies in float32 (NVFP4: see below)
    deq = {p: qe.weight_dequantized(p, torch.float64 if r.weight.two_level else torch.float32)
           for p in ("gate_up", "down")}
    i = qe.intermediate_dim
    for e in range(qe.num_experts):
        for proj, rows in (("gate_proj", deq["gate_up"][e, :i]), ("up_proj", deq["gate_up"][e, i:]),
                           ("down_proj", deq["down"][e])):
            pre = f"model.layers.1.mlp.experts.{e}.{proj}."
            local = {k[len(pre):]: v for k, v in _tensors(out, [n for n in names if n.startswith(pre)]).items()}
            dense = comp.decompress(dict(local), _ct_scheme(r.weight, r.act))["weight"]
            if r.weight.two_level:
                # compressed-tensors divides by the stored 1/g (one fp32 rounding of g, 2^-24
                # relative) and rounds the product to bf16 (2^-8 relative): element by element
                err = (dense.double() - rows).abs()
                assert bool((err <= (2.0 ** -8 + 2.0 ** -22) * rows.abs()).all()), (e, proj)
            else:
                assert torch.equal(dense.float(), rows), (e, proj)


# transformers 5 with CompressedTensorsConfig(dequantize=True) dequantizes each expert's tensors
# and merges them into the fused parameters (its conversion mapping). What it does not load right
# (transformers 5.24, integrations/compressed_tensors.py, CompressedTensorsDequantize):
# - nvfp4: its per-expert DummyModule carries weight_packed / weight_scale / weight_shape only,
#   so weight_global_scale is dropped and the weights come out scaled by the tensor scale's inverse;
# - w4a16-asym: the same module drops weight_zero_point;
# - mxfp8: every 8-bit float scheme is taken as (fp8 weight x float scale), and the e8m0 scale
#   codes [N, K/32] are multiplied into [N, K] (a shape error);
# - w8a8-int8 (format int-quantized: int8 `weight` + `weight_scale`, nothing packed): experts are
#   decompressed only from `weight_packed`, so none is found and the merge fails ("Concatenate ...
#   Ckpt contains: 0").
# compressed-tensors itself decompresses every one of these exactly (the test above).
HF_RECIPES = ("w8a16-int8", "w4a16", "w4a16-g32", "w8a8-fp8", "mxfp4")


@pytest.mark.parametrize("family,recipe", [("qwen3_moe", r) for r in HF_RECIPES] + [("mixtral", "w4a16-g32"),
                                                                                     ("qwen2_moe", "w8a8-fp8")])
def test_transformers_dequantizes_experts(family, recipe, rng, tmp_path):
    m = _model(family, recipe, rng)
    out = save_compressed(m, tmp_path / "ck", recipe)
    for x in m.modules():                 # transformers' dequantized model runs activations unquantized
        if isinstance(x, (QuantLinear, QuantExperts)):
            x.act_scheme = None
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(
            dequantize=True, **{k: v for k, v in qc.items() if k != "quant_method"}))
    for n, x in m.named_modules():
        if isinstance(x, QuantExperts):
            h = hf.get_submodule(n)
            for p in ("gate_up", "down"):
                # MX weights arrive in bf16 (compressed-tensors' dtype), where they are exact
                assert torch.equal(getattr(h, p + "_proj").float(), x.weight_dequantized(p, torch.float32)), (n, p)
        elif isinstance(x, QuantLinear):
            assert torch.equal(hf.get_submodule(n).weight.float(), x.weight_q.dequantize(torch.float32)), n
    hf.float()
    t = ids(rng, 11)
    with torch.no_grad():
        ref, got = m(t).logits, hf(t).logits
    # the same dequantized weights, float32 forwards (lowbit's experts in float64) differing only
    # in summation order (family_fixtures.logits_gate derives the gate)
    assert (got - ref).abs().max().item() <= logits_gate(m.config, ref)


# ------------------------------------------------------------------ float experts, bad input
def test_float_experts_are_written_per_expert_and_ignored(rng, tmp_path):
    m = tiny_moe("mixtral", rng, dtype=torch.float32, experts=3)
    experts = [n for n, x in m.named_modules() if type(x).__name__ == "MixtralExperts"]
    quantize_model(m, "w8a16-int8", ignore=experts)
    out = save_compressed(m, tmp_path / "ck", "w8a16-int8")
    names = _keys(out)
    assert {f"model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight" for i in (0, 1) for e in range(3)
            for p in ("w1", "w2", "w3")} <= names
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # ignored under Mixtral's names and under those vLLM looks a MoE layer's scheme up by
    for n in ("model.layers.0.block_sparse_moe.experts.2.w3", "model.layers.1.block_sparse_moe.experts.0.gate_proj"):
        assert _targeted(n, qc["ignore"]), n
    assert not _targeted("model.layers.0.self_attn.q_proj", qc["ignore"])
    back = load_compressed(out).to_model()
    back.set_experts_implementation("eager")      # the float experts run as the original's do
    for n in experts:
        for p in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(back.get_submodule(n), p), getattr(m.get_submodule(n), p))
    t = ids(rng, 7)
    with torch.no_grad():
        assert torch.equal(back(t).logits, m(t).logits)


def test_expert_count_disagreeing_with_the_config(rng, tmp_path):
    m = _model("qwen3_moe", "w8a16-int8", rng, experts=3)
    cfg = m.config.to_dict()
    cfg["num_local_experts"] = 5              # Qwen3-MoE's key in transformers 5
    with pytest.raises(ValueError, match=r"holds 3 experts.*num_local_experts = 5"):
        save_compressed(m, tmp_path / "bad", "w8a16-int8", config=cfg)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())     # nothing written half-way
    out = save_compressed(m, tmp_path / "ck", "w8a16-int8")
    path = out / "config.json"
    for n in (2, 4):
        c = json.loads(path.read_text())
        c["num_local_experts"] = n
        path.write_text(json.dumps(c))
        with pytest.raises(CheckpointError, match=rf"holds 3 experts .*num_local_experts = {n}"):
            load_compressed(out).to_model()


def test_missing_expert_projection_is_named(rng, tmp_path):
    from safetensors.torch import load_file, save_file
    m = _model("olmoe", "w8a16-int8", rng, experts=3)
    out = save_compressed(m, tmp_path / "ck", "w8a16-int8")
    f = out / "model.safetensors"
    sd = {k: v for k, v in load_file(str(f)).items() if ".experts.1.up_proj." not in k or "layers.0." not in k}
    save_file(sd, str(f), metadata={"format": "pt"})
    side = out / "lowbit.json"
    s = json.loads(side.read_text())
    del s["layers"]["model.layers.0.mlp.experts.1.up_proj"]
    side.write_text(json.dumps(s))
    with pytest.raises(CheckpointError, match=r"no up_proj for expert 1"):
        load_compressed(out).to_model()


def test_gpt_oss_experts_refused_by_name(rng, tmp_path):
    m = _model("gpt_oss", "w8a16-int8", rng, experts=4)
    with pytest.raises(NotImplementedError, match=r"gpt_oss.*fused.*ignore=\["):
        save_compressed(m, tmp_path / "ck", "w8a16-int8")
    assert not (tmp_path / "ck").exists()


def _targeted(name, targets):
    """compressed-tensors' rule: an exact name, or a ``re:`` pattern matching from the start."""
    return any(t == name or (t.startswith("re:") and re.match(t[3:], name)) for t in targets)


def _bits(name, qc):
    hits = [g["weights"]["num_bits"] for g in qc["config_groups"].values() if _targeted(name, g["targets"])]
    assert len(hits) == 1, (name, hits)
    return hits[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_mixed_schemes_target_every_expert_as_vllm_looks_it_up(family, rng, tmp_path):
    """An override on one experts module: one config group per scheme. vLLM looks a MoE layer's
    scheme up by ``<experts>.0.gate_proj`` / ``up_proj`` / ``down_proj`` whatever the family
    calls them; each group's targets must name the experts both ways."""
    m = tiny_moe(family, rng, dtype=torch.float32, experts=3)
    quantize_model(m, "w8a16-int8", overrides={"model.layers.1.mlp.experts": "w4a16-g32"})
    out = save_compressed(m, tmp_path / "ck")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    block, *projs = VLLM_NAMES[family]
    for p in set(projs) | {"gate_proj", "up_proj", "down_proj"}:
        assert _bits(f"model.layers.1.{block}.experts.2.{p}", qc) == 4
        assert _bits(f"model.layers.0.{block}.experts.0.{p}", qc) == 8
    assert _bits("model.layers.0.self_attn.q_proj", qc) == 8
    twin = copy.deepcopy(m)
    back = load_compressed(out).to_model()
    t = ids(rng, 7)
    with torch.no_grad():
        assert torch.equal(back(t).logits, twin(t).logits)


# ------------------------------------------------------------------ tensor by tensor
@pytest.mark.parametrize("family,recipe", [("mixtral", "w4a16-g32"), ("qwen3_moe", "w8a8-int8"),
                                           ("deepseek_v3", "mxfp4")])
def test_tensorwise_writes_what_the_whole_model_path_writes(family, recipe, rng, tmp_path):
    """The float checkpoint transformers writes (per-expert weights) quantized tensor by tensor
    gives the same files as quantizing the loaded model: per-channel / per-group scales are
    row-local, so each expert's gate and up quantized alone are the rows of its gate_up."""
    from lowbit.pipelines.tensorwise import quantize_checkpoint
    m = tiny_moe(family, rng, dtype=torch.float32, experts=4)
    m.save_pretrained(tmp_path / "float")
    quantize_checkpoint(tmp_path / "float", tmp_path / "tw", recipe)
    quantize_model(m, recipe)
    save_compressed(m, tmp_path / "whole", recipe)
    a, b = checkpoint_files(tmp_path / "tw"), checkpoint_files(tmp_path / "whole")
    assert set(a) == set(b)
    ta, tb = _tensors(tmp_path / "tw", sorted(a)), _tensors(tmp_path / "whole", sorted(b))
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and torch.equal(ta[n], tb[n]), n
    qa = json.loads((tmp_path / "tw" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "whole" / "config.json").read_text())["quantization_config"]
    assert qa["ignore"] == qb["ignore"] and qa["config_groups"] == qb["config_groups"]
    back = load_compressed(tmp_path / "tw").to_model()
    t = ids(rng, 7)
    with torch.no_grad():
        assert torch.equal(back(t).logits, m(t).logits)


def test_tensorwise_refuses_one_scale_per_expert(rng, tmp_path):
    from lowbit.pipelines.tensorwise import quantize_checkpoint
    tiny_moe("olmoe", rng, dtype=torch.float32, experts=4).save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="nvfp4.*gate and up would get one each"):
        quantize_checkpoint(tmp_path / "float", tmp_path / "q", "nvfp4")
    assert not (tmp_path / "q").exists()
    from safetensors.torch import save_file
    m = tiny_moe("qwen3_moe", rng, dtype=torch.float32, experts=4)
    m.save_pretrained(tmp_path / "fused")        # then the experts stored fused, under the module's names
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no per-expert weight model\.layers\.0\.mlp\.experts\.0\.down_proj"):
        quantize_checkpoint(tmp_path / "fused", tmp_path / "q", "w8a16-int8")
    assert not (tmp_path / "q").exists()
    tiny_moe("gpt_oss", rng, dtype=torch.float32, experts=4).save_pretrained(tmp_path / "oss")
    with pytest.raises(NotImplementedError, match="fused"):
        quantize_checkpoint(tmp_path / "oss", tmp_path / "q", "w8a16-int8")
    assert not (tmp_path / "q").exists()


# ------------------------------------------------------------------ the grouped kernels after loading
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("recipe,kernel", [("w8a8-int8", "kernel:int8"), ("w4a16-g32", "kernel:w4a16")])
def test_loaded_experts_run_the_grouped_kernels(recipe, kernel, rng, tmp_path):
    """The reloaded experts feed the grouped Triton kernels (Triton's interpreter without a
    GPU) the operands the quantized model feeds them: the same launch, identical outputs."""
    m = _model("qwen3_moe", recipe, rng)
    out = save_compressed(m, tmp_path / "ck", recipe)
    back = load_compressed(out).to_model()
    h = torch.randn(13, m.config.hidden_size, generator=rng)
    top = torch.randint(0, 4, (13, 2), generator=rng)
    w = torch.rand(13, 2, generator=rng)
    for n, a in m.named_modules():
        if isinstance(a, QuantExperts):
            b = back.get_submodule(n)
            outs = []
            for x in (a, b):
                x.to(DEV).backend = "kernel"
                with torch.no_grad():
                    outs.append(x(h.to(DEV), top.to(DEV), w.to(DEV)))
                assert x.last_path == kernel
            assert torch.equal(outs[0], outs[1]), n


def test_serving_dtype_leaves_expert_codes_and_scales_alone(rng, tmp_path):
    """to_model(dtype=bf16) casts what is not quantized; the experts' codes, fp32 scales and
    biases are the arithmetic's own formats and come through bit for bit."""
    m = _model("qwen3_moe", "w4a16-g32", rng)
    out = save_compressed(m, tmp_path / "ck", "w4a16-g32")
    back = load_compressed(out).to_model(dtype=torch.bfloat16)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    for n, a in m.named_modules():
        if isinstance(a, QuantExperts):
            b = dict(back.get_submodule(n).named_buffers())
            for k, v in a.named_buffers():
                assert b[k].dtype == v.dtype and torch.equal(b[k], v), (n, k)
    with torch.no_grad():
        assert back(ids(rng, 5)).logits.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prepared GPU path needs CUDA")
@pytest.mark.parametrize("recipe,kernel", [("w8a8-int8", "kernel:int8"), ("w4a16-g32", "kernel:w4a16")])
def test_to_model_on_the_gpu_serves_the_experts_with_grouped_kernels(recipe, kernel, rng, tmp_path):
    m = _model("qwen3_moe", recipe, rng)
    out = save_compressed(m, tmp_path / "ck", recipe)
    back = load_compressed(out).to_model(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        logits = back(ids(rng, 9).cuda()).logits
    assert torch.isfinite(logits).all()
    experts = [x for x in back.modules() if isinstance(x, QuantExperts)]
    # the kernel's operands are on the GPU (a 4-bit module's one-code-per-byte twin stays on the host)
    assert experts and all(getattr(x, b).is_cuda for x in experts for p in x._ops for b in x._ops[p].values())
    assert [x.last_path for x in experts] == [kernel] * len(experts)


def test_experts_of_no_known_family_are_refused(rng, tmp_path):
    m = _model("olmoe", "w8a16-int8", rng, experts=3)
    m.model.layers[0].mlp.experts.family = "mystery"
    with pytest.raises(ValueError, match="'mystery'"):
        save_compressed(m, tmp_path / "ck", "w8a16-int8")
    assert not (tmp_path / "ck").exists()
