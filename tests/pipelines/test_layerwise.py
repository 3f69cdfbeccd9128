"""Layer-by-layer quantization from a sharded safetensors checkpoint (lowbit.pipelines.layerwise) gives the
checkpoint the whole-model path gives: the same codes, scales, static activation scales and
float tensors, bit for bit, for SmoothQuant + static scales + RTN and for GPTQ."""

import pytest
import torch

from llama_fixtures import outlier_llama

from lowbit.pipelines.steps import AWQ, GPTQ, MSEScales, SmoothQuant, StaticScales
from lowbit.workflows.job import Measures, parse_method


def _sharded(rng, tmp_path):
    model = outlier_llama(rng, intermediate_size=96)
    d = tmp_path / "float"
    model.save_pretrained(d, max_shard_size="40KB")      # several shards + index
    assert (d / "model.safetensors.index.json").is_file()
    batches = [torch.randint(0, 97, (2, 17), generator=rng) for _ in range(3)]
    return d, batches


def _whole_model(d, recipe, batches, out, *, smoothquant=None, static=False, method="rtn"):
    from transformers import AutoModelForCausalLM
    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.algorithms.static_scales import calibrate_static_scales
    from lowbit.pipelines.quantize_model import quantize_model
    from lowbit.recipes.presets import get_recipe
    from lowbit.algorithms.smoothquant import smooth_model
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if smoothquant is not None:
        smooth_model(m, batches, alpha=smoothquant)
    scales = calibrate_static_scales(m, batches, get_recipe(recipe).act) if static else None
    quantize_model(m, recipe, act_static_scales=scales, method=method, calib=batches if method != "rtn" else None)
    save_compressed(m, out)


def _assert_same(a, b):
    from lowbit.pipelines.checkpoint import load_compressed
    x, y = load_compressed(a), load_compressed(b)
    assert sorted(x.qtensors) == sorted(y.qtensors) and x.qtensors
    for n in x.qtensors:
        p, q = x.qtensors[n], y.qtensors[n]
        for f in ("codes", "scale", "zero_point", "scale_codes", "global_scale"):
            u, v = getattr(p, f), getattr(q, f)
            assert (u is None and v is None) or torch.equal(u, v), (n, f)
        assert p.scheme == q.scheme and x.act_schemes[n] == y.act_schemes[n]
    assert sorted(x.act_static_scales) == sorted(y.act_static_scales)
    for n in x.act_static_scales:
        assert torch.equal(x.act_static_scales[n], y.act_static_scales[n]), n
    assert sorted(x.tensors) == sorted(y.tensors)
    for n in x.tensors:
        assert torch.equal(x.tensors[n], y.tensors[n]), n
    assert x.quantization_config == y.quantization_config


# Two cases cover both quantizers (RTN, GPTQ) and all three activation streams (F, S, Q).
@pytest.mark.parametrize("recipe,opts", [
    ("w8a8-int8", {"smoothquant": 0.5, "static": True}),
    ("w8a8-int8", {"smoothquant": 0.5, "static": True, "method": "gptq"}),
])
def test_layerwise_equals_whole_model(rng, tmp_path, recipe, opts, monkeypatch):
    from lowbit.pipelines import layer_rtn
    from lowbit.algorithms import smoothquant
    from lowbit.pipelines.layerwise import quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    _whole_model(d, recipe, batches, tmp_path / "whole", **opts)
    # the layer-by-layer path's row chunks (quantization, SmoothQuant's maxima and folds) small
    # enough that every weight is cut into several, some of one row
    for mod in (layer_rtn, smoothquant):
        monkeypatch.setattr(mod, "_CHUNK", int(torch.randint(1, 300, (1,), generator=rng)))
    res = quantize_layerwise(d, tmp_path / "layerwise", recipe, batches, steps=Measures(**opts).steps())
    _assert_same(tmp_path / "whole", tmp_path / "layerwise")
    assert res["layers"] == 2 and len(res["seconds_per_layer"]) == 2
    assert res["layer_bytes"] > 0 and res["activation_bytes"] > 0


def test_layerwise_refuses_bad_input(rng, tmp_path):
    from lowbit.pipelines.layerwise import quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    with pytest.raises(ValueError, match="weight-only"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", batches, steps=[StaticScales()])
    with pytest.raises(ValueError, match="calibration batches"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", [], steps=[GPTQ()])
    with pytest.raises(ValueError, match="AWQ, MSEScales not available layer by layer"):
        quantize_layerwise(d, tmp_path / "o", "w4a16", batches, steps=[AWQ(), MSEScales()])
    assert not (tmp_path / "o").exists()


def test_layerwise_options_object_and_keywords_are_one_path(rng, tmp_path):
    """LayerwiseOptions carries the same settings as keywords: the same files, byte for byte (the
    settings chosen so that each changes them: an ignored MLP, small shards); keywords replace the
    object's fields; an unknown name or a dict in place of the options is refused before anything
    is read or written."""
    import filecmp
    from lowbit.pipelines.layerwise import LayerwiseOptions, quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    kw = {"ignore": ["model.layers.1.mlp.*"], "max_shard_bytes": int(torch.randint(8_000, 16_000, (1,), generator=rng))}
    res = quantize_layerwise(d, tmp_path / "a", "w8a8-int8", batches, **kw)
    quantize_layerwise(d, tmp_path / "b", "w8a8-int8", batches, LayerwiseOptions(**kw))
    quantize_layerwise(d, tmp_path / "c", "w8a8-int8", batches, LayerwiseOptions(ignore=["nothing"], max_shard_bytes=1),
                       **kw)
    assert "model.layers.1.mlp.down_proj" in res["kept"] and "model.layers.0.mlp.down_proj" in res["quantized"]
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert sum(n.endswith(".safetensors") for n in names) > 2     # the layers and the rest: 2 by default
    for other in ("b", "c"):
        assert names == sorted(p.name for p in (tmp_path / other).iterdir())
        assert all(filecmp.cmp(tmp_path / "a" / n, tmp_path / other / n, shallow=False) for n in names), other
    with pytest.raises(TypeError, match=r"quantize_layerwise got an unknown option 'ignor'.*did you mean 'ignore'"):
        quantize_layerwise(d, tmp_path / "o", "w8a8-int8", batches, ignor=kw["ignore"])
    with pytest.raises(TypeError, match="options must be a LayerwiseOptions"):
        quantize_layerwise(d, tmp_path / "o", "w8a8-int8", batches, kw)
    assert not (tmp_path / "o").exists()


def test_cli_sequential(rng, tmp_path, capsys, monkeypatch):
    """`lowbit quantize --sequential` on a tiny sharded Llama (random calibration windows in place of
    tokenized text): the flags reach quantize_layerwise (static scales stored, SmoothQuant folded
    into the norms), and flags it does not support are refused."""
    from lowbit.entrypoints.main import main
    from lowbit.pipelines.checkpoint import load_compressed
    from lowbit.workflows import sequential as wf_sequential
    d, _ = _sharded(rng, tmp_path)
    ids = torch.randint(0, 97, (64,), generator=rng)
    monkeypatch.setattr(wf_sequential, "calibration_windows", lambda m, tokens, window: [ids[None, :32], ids[None, 32:]])
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(d), "--sequential", "--recipe", "w8a8-int8", "--smoothquant", "0.5",
               "--static-scales", "--calib-tokens", "64", "--window", "32", "--out", str(out), "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    ck = load_compressed(out)
    assert len(ck.qtensors) == 14 and len(ck.act_static_scales) == 14
    from transformers import LlamaForCausalLM
    orig = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).model.layers[0].input_layernorm.weight
    assert not torch.equal(ck.tensors["model.layers.0.input_layernorm.weight"], orig.detach())
    rc = main(["quantize", "--model", str(d), "--sequential", "--awq", "--out", str(tmp_path / "x")])
    assert rc == 2 and "--awq" in capsys.readouterr().err


def test_layer_is_allocated_in_the_compute_dtype(rng, tmp_path, monkeypatch):
    """The meta model is float32 whatever config.json says; a layer allocated from it before the
    cast held the layer in float32 (2x a bf16 layer: the 2-GPU run's memory excess)."""
    from lowbit.pipelines.layerwise import quantize_layerwise
    d, batches = _sharded(rng, tmp_path)
    seen, to_empty = set(), torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        seen.update(p.dtype for p in self.parameters())
        return to_empty(self, device=device, recurse=recurse)
    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    res = quantize_layerwise(d, tmp_path / "q", "w8a8-int8", batches, steps=[SmoothQuant(0.5), StaticScales()],
                             dtype=torch.bfloat16)
    assert seen == {torch.bfloat16}
    assert res["layer_bytes"] == sum(p.numel() * 2 for p in _layer_params(d))
    assert set(res["phase_seconds"]) >= {"setup", "first_inputs", "load", "calibrate", "quantize", "write", "finish"}
    # the phases are consecutive intervals from the start to the last boundary, and "seconds" is
    # read just after it: they add up to the wall time (up to the clock reads between them)
    assert abs(sum(res["phase_seconds"].values()) - res["seconds"]) < 0.05


def _layer_params(d):
    from transformers import LlamaForCausalLM
    return list(LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).model.layers[0].parameters())


def test_layerwise_smoothquant_phi3(rng, tmp_path):
    """SmoothQuant layer by layer reads the decoder map too: Phi-3's fused projections (its up half
    of gate_up_proj folded into down_proj) give the whole-model path's checkpoint bit for bit."""
    from family_fixtures import tiny_decoder
    from lowbit.pipelines.layerwise import quantize_layerwise
    d = tmp_path / "float"
    tiny_decoder("phi3", rng).float().save_pretrained(d, max_shard_size="40KB")
    batches = [torch.randint(0, 97, (2, 17), generator=rng) for _ in range(2)]
    _whole_model(d, "w8a8-int8", batches, tmp_path / "whole", smoothquant=0.5)
    quantize_layerwise(d, tmp_path / "layerwise", "w8a8-int8", batches, steps=[SmoothQuant(0.5)])
    _assert_same(tmp_path / "whole", tmp_path / "layerwise")


def test_layerwise_refuses_gemma_embedding(rng, tmp_path):
    from family_fixtures import tiny_decoder
    from lowbit.pipelines.layerwise import quantize_layerwise
    tiny_decoder("gemma2", rng).float().save_pretrained(tmp_path / "float")
    with pytest.raises(NotImplementedError, match=r"Gemma 2: .*\['model.embed_tokens.embed_scale'\] are set at"):
        quantize_layerwise(tmp_path / "float", tmp_path / "o", "w4a16", [torch.randint(0, 97, (1, 8))])
    assert not (tmp_path / "o").exists()


def test_layerwise_refuses_unmapped_family(rng, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    from lowbit.archs.decoders import UnsupportedArchitecture
    from lowbit.pipelines.layerwise import quantize_layerwise
    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=32)).save_pretrained(
        tmp_path / "float")
    with pytest.raises(UnsupportedArchitecture, match="model_type='gpt2'"):
        quantize_layerwise(tmp_path / "float", tmp_path / "o", "w4a16", [torch.randint(0, 97, (1, 8))])
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ MoE experts
def _moe_checkpoint(family, rng, tmp_path, experts):
    from moe_fixtures import tiny_moe
    d = tmp_path / "float"
    # several shards: a layer's per-expert tensors spread over files
    tiny_moe(family, rng, dtype=torch.float32, experts=experts).save_pretrained(d, max_shard_size="60KB")
    assert (d / "model.safetensors.index.json").is_file()
    return d


def _file_tensors(d):
    from lowbit.io.st_format import TensorReader, checkpoint_files
    out = {}
    for n, path in checkpoint_files(d).items():
        with TensorReader(path) as r:
            out[n] = r.get(n)
    return out


# RTN on every family layer-by-layer maps (w8a8-int8: per-channel int8 weights with dynamic int8
# activations; w4a16-g32: packed int4 codes in groups of 32), one with experts kept in float,
# and GPTQ per expert (a dense Linear recipe on the attention, the experts' own rule).
MOE_CASES = [("mixtral", "w8a8-int8", "rtn", None), ("mixtral", "w4a16-g32", "rtn", None),
             ("qwen2_moe", "w4a16-g32", "rtn", None), ("qwen3_moe", "w8a8-int8", "rtn", "model.layers.1.mlp.experts"),
             ("olmoe", "w4a16-g32", "rtn", None), ("deepseek_v3", "w8a8-int8", "rtn", None),
             ("mixtral", "w4a16-g32", "gptq", None), ("qwen2_moe", "w8a8-int8", "gptq", None)]


@pytest.mark.parametrize("family,recipe,method,ignore", MOE_CASES)
def test_layerwise_moe_equals_whole_model(rng, tmp_path, family, recipe, method, ignore):
    """The layer-by-layer checkpoint of a MoE model is the whole-model path's (quantize_model +
    save_compressed), tensor for tensor and bit for bit: the per-expert codes and scales under
    the family's own names, the router and shared-expert gate kept in float, the float tensors,
    config.json's quantization_config; lowbit's loader turns it into a model whose logits are the
    in-memory quantized model's (same codes, same code path: identical)."""
    import json
    from transformers import AutoModelForCausalLM
    from lowbit.nn.experts import QuantExperts
    from lowbit.pipelines.checkpoint import load_compressed, save_compressed
    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.pipelines.quantize_model import quantize_model
    from moe_fixtures import ids
    experts = 2 * int(torch.randint(2, 4, (1,), generator=rng))     # 4 or 6 (DeepSeek-V3: 2 groups of >= 2)
    d = _moe_checkpoint(family, rng, tmp_path, experts)
    # GPTQ per expert needs 32 routed tokens an expert: 3 x 2 x 40 tokens, top-2 of <= 6 experts
    batches = [torch.randint(0, 97, (2, int(torch.randint(33, 48, (1,), generator=rng))), generator=rng)
               for _ in range(3)]
    kw = {"ignore": [ignore]} if ignore else {}
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    # from_pretrained leaves tensors in the file's mapping, at any 4-byte address; the CPU's float
    # GEMV of a one-row Linear (Qwen2-MoE's shared_expert_gate) rounds differently with the
    # operand's alignment (seen: 1 ulp), so the reference gets allocator storage as the loader's
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            t.data = t.data.clone()
    summary = quantize_model(m, recipe, method=method, calib=batches if method == "gptq" else None, **kw)
    save_compressed(m, tmp_path / "whole")
    res = quantize_layerwise(d, tmp_path / "layerwise", recipe, batches, steps=parse_method(method), **kw)

    a, b = _file_tensors(tmp_path / "whole"), _file_tensors(tmp_path / "layerwise")
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    # the names are the family's checkpoint names: transformers' own for what stays float
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    moe_layer = 1 if family == "deepseek_v3" else 0          # DeepSeek-V3's first layer is dense here
    assert f"model.layers.{moe_layer}.{block}.gate.weight" in b
    suffix = "weight_packed" if recipe == "w4a16-g32" else "weight"
    down = "w2" if family == "mixtral" else "down_proj"
    assert f"model.layers.{moe_layer}.{block}.experts.{experts - 1}.{down}.{suffix}" in b
    if ignore:           # float experts: per expert, as transformers names them, and ignored
        assert "model.layers.1.mlp.experts.0.up_proj.weight" in b
    qa, qb = (json.loads((tmp_path / x / "config.json").read_text())["quantization_config"]
              for x in ("whole", "layerwise"))
    assert qa == qb
    _assert_same(tmp_path / "whole", tmp_path / "layerwise")

    # the run's report: which experts modules, and GPTQ's per-expert account as quantize_model's
    assert res["experts"] == {e.name: {"action": e.action, "recipe": e.recipe, "reason": e.reason,
                                       "calibration": None if e.calibration is None else str(e.calibration)}
                              for e in summary.experts}
    if method == "gptq":     # not every expert fell back to round to nearest: GPTQ ran
        assert any(f.choice.get("gate_up") == "gptq" for e in summary.experts for f in e.calibration.experts)

    back = load_compressed(tmp_path / "layerwise").to_model()
    qe = {n for n, x in m.named_modules() if isinstance(x, QuantExperts)}
    assert qe and qe == {n for n, x in back.named_modules() if isinstance(x, QuantExperts)}
    assert (ignore in qe) is False
    x = ids(rng, int(torch.randint(5, 12, (1,), generator=rng)))
    with torch.no_grad():
        assert torch.equal(back(x).logits, m(x).logits)


def test_layerwise_refuses_unmapped_expert_layout(rng, tmp_path):
    """A checkpoint whose experts are stored neither fused nor under the family's per-expert names
    (here Mixtral's experts under Qwen's gate_proj / up_proj / down_proj) is refused before any
    layer is read, naming the module and the family."""
    from safetensors.torch import load_file, save_file
    from lowbit.io.st_format import CheckpointError
    from lowbit.pipelines.layerwise import quantize_layerwise
    d = _moe_checkpoint("mixtral", rng, tmp_path, 4)
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        save_file({k.replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj."): v
                   for k, v in t.items()}, f, metadata={"format": "pt"})
    idx = d / "model.safetensors.index.json"
    idx.write_text(idx.read_text().replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.")
                   .replace(".w2.", ".down_proj."))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts \(mixtral experts\): .*neither the "
                                              r"fused .*gate_up_proj nor the per-expert .*block_sparse_moe\.experts\.0"
                                              r"\.w1\.weight.*cannot map"):
        quantize_layerwise(d, tmp_path / "o", "w4a16-g32", [torch.randint(0, 97, (1, 8))])
    assert not (tmp_path / "o").exists()


def test_layerwise_refuses_moe_by_name(rng, tmp_path):
    """What layer by layer does not do for MoE models is refused by name before anything is
    written: a family outside its list (gpt-oss: fused experts in its checkpoints, layers of two
    attention types), SmoothQuant (no exact fold point for the experts) and static activation
    scales (quantize_model refuses them for experts too)."""
    from moe_fixtures import tiny_moe
    from lowbit.archs.decoders import UnsupportedArchitecture
    from lowbit.pipelines.layerwise import quantize_layerwise
    calib = [torch.randint(0, 97, (1, 8))]
    tiny_moe("gpt_oss", rng, dtype=torch.float32).save_pretrained(tmp_path / "oss")
    with pytest.raises(NotImplementedError, match=r"GptOssForCausalLM: .*does not support gpt_oss experts \(model\."
                                                  r"layers\.0\.mlp\.experts, \.\.\.\).*without --sequential.*quantize_model"):
        quantize_layerwise(tmp_path / "oss", tmp_path / "o", "w4a16-g32", calib)
    d = _moe_checkpoint("qwen3_moe", rng, tmp_path, 4)
    with pytest.raises(UnsupportedArchitecture, match="SmoothQuant on qwen3_moe: .*smooth_experts .*layer-by-layer path does not run it yet.*--gptq.*--ignore"):
        quantize_layerwise(d, tmp_path / "o", "w8a8-int8", calib, steps=[SmoothQuant(0.5)])
    with pytest.raises(NotImplementedError, match=r"static_scales: .*MoE experts \(model\.layers\.0\.mlp\.experts"):
        quantize_layerwise(d, tmp_path / "o", "w8a8-int8", calib, steps=[StaticScales()])
    assert not (tmp_path / "o").exists()


def _moe_worker(rank: int, tmp: str, batches):
    import torch.distributed as dist
    from lowbit.algorithms.distributed import shard
    from lowbit.pipelines.layerwise import quantize_layerwise
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)       # the same matmul kernels as the single-process run
        for method in ("rtn", "gptq"):
            quantize_layerwise(f"{tmp}/float", f"{tmp}/dist-{method}" if rank == 0 else None, "w4a16-g32",
                               shard(batches), steps=parse_method(method))
    finally:
        dist.destroy_process_group()


def test_layerwise_moe_two_gloo_ranks_write_the_single_process_checkpoint(rng, tmp_path):
    """Under torch.distributed (2 gloo ranks, each with its share of the batches) a Mixtral
    checkpoint layer by layer is the one-process directory byte for byte: each rank reads a share
    of every layer's per-expert tensors (the pieces broadcast), round to nearest quantizes the
    experts on rank 0, GPTQ per expert sums the routed token counts and Hessians over the ranks."""
    import filecmp
    import torch.multiprocessing as mp
    from lowbit.pipelines.layerwise import quantize_layerwise
    d = _moe_checkpoint("mixtral", rng, tmp_path, 4)
    batches = [torch.randint(0, 97, (2, int(torch.randint(30, 45, (1,), generator=rng))), generator=rng)
               for _ in range(3)]      # odd: the ranks' shares differ in size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for method in ("rtn", "gptq"):
            quantize_layerwise(d, tmp_path / f"one-{method}", "w4a16-g32", batches, steps=parse_method(method))
    finally:
        torch.set_num_threads(threads)
    mp.start_processes(_moe_worker, args=(str(tmp_path), batches), nprocs=2, join=True, start_method="fork")
    for method in ("rtn", "gptq"):
        a, b = tmp_path / f"one-{method}", tmp_path / f"dist-{method}"
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir())
        differ = [n for n in names if not filecmp.cmp(a / n, b / n, shallow=False)]
        assert not differ, f"{method}: files {differ} differ between 1 process and 2 ranks"


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_layerwise_keeps_what_transformers_keeps_in_float32(rng, tmp_path, method):
    """In bf16, from_pretrained keeps DeepSeek-V3's e_score_correction_bias (and, in newer
    transformers, its router weight) in float32 (_keep_in_fp32_modules_strict): layer by layer
    loads, runs and stores them so too (read from the file in float32, not through bf16), and the
    checkpoint is the bf16 whole-model path's bit for bit."""
    from transformers import AutoModelForCausalLM
    from moe_fixtures import tiny_moe
    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.pipelines.quantize_model import quantize_model
    d = tmp_path / "float"
    m = tiny_moe("deepseek_v3", rng, dtype=torch.float32, experts=4)
    with torch.no_grad():     # a bias that bf16 would round: stored in float32, it must stay exact
        m.model.layers[1].mlp.gate.e_score_correction_bias.normal_(generator=rng)
    m.save_pretrained(d, max_shard_size="60KB")   # float32 on disk
    batches = [torch.randint(0, 97, (2, int(torch.randint(33, 48, (1,), generator=rng))), generator=rng)
               for _ in range(3)]
    w = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    # what from_pretrained kept in float32 (the strict list differs between transformers versions:
    # 5.17 keeps the bias only, 5.24 the router weight too)
    gate_dtype = w.model.layers[1].mlp.gate.weight.dtype
    assert w.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    quantize_model(w, "w4a16-g32", method=method, calib=batches if method == "gptq" else None)
    save_compressed(w, tmp_path / "whole")
    quantize_layerwise(d, tmp_path / "layerwise", "w4a16-g32", batches, steps=parse_method(method),
                       dtype=torch.bfloat16)
    a, b = _file_tensors(tmp_path / "whole"), _file_tensors(tmp_path / "layerwise")
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    bias = b["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and b["model.layers.1.mlp.gate.weight"].dtype == gate_dtype
    assert torch.equal(bias, m.model.layers[1].mlp.gate.e_score_correction_bias)
    assert b["model.layers.1.input_layernorm.weight"].dtype == torch.bfloat16


def test_cli_sequential_moe(rng, tmp_path, capsys, monkeypatch):
    """`lowbit quantize --sequential` on a tiny Mixtral checkpoint (random calibration windows in
    place of tokenized text): every expert is written per expert under Mixtral's names, the router
    kept in float, and the printed summary carries the experts' report."""
    import json
    from lowbit.entrypoints.main import main
    from lowbit.workflows import sequential as wf_sequential
    from lowbit.pipelines.checkpoint import load_compressed
    d = _moe_checkpoint("mixtral", rng, tmp_path, 4)
    ids = torch.randint(0, 97, (64,), generator=rng)
    monkeypatch.setattr(wf_sequential, "calibration_windows", lambda m, tokens, window: [ids[None, :32], ids[None, 32:]])
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(d), "--sequential", "--recipe", "w4a16-g32", "--calib-tokens", "64",
               "--window", "32", "--out", str(out), "--device", "cpu"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    ck = load_compressed(out)
    experts = [n for n in ck.qtensors if ".block_sparse_moe.experts." in n]
    assert len(experts) == 2 * 4 * 3 and "model.layers.0.block_sparse_moe.gate.weight" in ck.tensors
    report = json.loads(printed.out.strip().splitlines()[-1])
    assert set(report["experts"]) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert "Linears and 2 experts modules quantized" in printed.out, printed.out
    assert "warning:" not in printed.out              # w4a16-g32 experts load in transformers and vLLM
    # the default W8A8 int8 is said before anything is written: transformers cannot load its experts
    # (lowbit.recipes.loaders); experts kept in float take the warning away
    lines = wf_sequential.loader_lines(str(d), "w8a8-int8", ())
    assert len(lines) == 1 and lines[0].startswith("transformers") and "experts" in lines[0], lines
    assert wf_sequential.loader_lines(str(d), "w8a8-int8", ("model.layers.*.mlp.experts",)) == []
