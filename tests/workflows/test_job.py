"""QuantizeJob and its steps: names are parsed and combinations refused when the job is built;
the library's quantize_job writes the checkpoint `lowbit quantize` writes for the same job, byte
for byte (a dense Llama and a MoE), and the same as the algorithms called one by one in the order
the job documents."""
import copy
import hashlib

import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.evaluation import workload
from lowbit.pipelines.checkpoint import save_compressed
from lowbit.workflows.job import BEST, Measures, QuantizeJob, best_line, best_steps, step_text
from lowbit.workflows.quantize import quantize_job
from lowbit.workflows.session import QuantizeSession, TextOptions
from lowbit.workflows.steps import (AWQ, GPTQ, KVCache, MSEScales, OverrideWorst, Rotate, SmoothQuant, StaticScales,
                                    Step)
from cli_fixtures import save_tokenizer
from moe_fixtures import tiny_moe

transformers = pytest.importorskip("transformers")


def test_build_parses_names_once_and_orders_the_steps():
    job = QuantizeJob.build("W8A8-INT8", [GPTQ(), OverrideWorst(0.05), SmoothQuant(0.5), Rotate()],
                            kv_cache="fp8-head", overrides={"mlp.*": "W8A8-FP8", "lm_head": "Skip"})
    assert job.recipe.name == "w8a8-int8"
    assert [type(s) for s in job.steps] == [Rotate, SmoothQuant, OverrideWorst, GPTQ, KVCache]
    assert job.kv_cache.scheme.granularity == "head" and job.kv_cache.name == "fp8-head"
    assert job.overrides == {"mlp.*": "w8a8-fp8", "lm_head": "skip"}
    assert job.measures() == {"rotate": "hadamard", "smoothquant": 0.5, "override_worst": 0.05, "method": "gptq"}


@pytest.mark.parametrize("build, why", [
    (lambda: QuantizeJob.build("w9a9"), "not a lowbit recipe"),
    (lambda: QuantizeJob.build("w8a8-int8", kv_cache="fp9"), "unknown format"),
    (lambda: QuantizeJob.build("w8a8-int8", lm_head="int3"), "lm_head='int3'"),
    (lambda: QuantizeJob.build("w8a8-int8", overrides={"x": "w9"}), "not a lowbit recipe"),
    (lambda: QuantizeJob.build("w4a16", [StaticScales()]), "weight-only"),
    (lambda: QuantizeJob.build("w4a16", [GPTQ()], lm_head="int8"), "--lm-head with --gptq"),
    (lambda: QuantizeJob.build("w4a16", [GPTQ(), GPTQ()]), "GPTQ given more than once"),
    (lambda: QuantizeJob.build("w4a16", [SmoothQuant(1.5)]), "alpha must lie in"),
    (lambda: Measures(method="awq").steps(), "method='awq'"),
    (lambda: Measures(rotate="givens").steps(), "rotate='givens'"),
    (lambda: Measures(override_by="nope").steps(), "override_by='nope'"),
])
def test_build_refuses_before_any_model(build, why):
    with pytest.raises(ValueError, match=why):
        build()


def test_build_refuses_what_is_not_a_step():
    with pytest.raises(TypeError, match="not a lowbit.workflows.steps.Step"):
        QuantizeJob.build("w4a16", ["gptq"])


def test_measures_and_best_speak_the_same_steps():
    m = Measures(smoothquant=0.5, override_worst=0.05, override_to="W8A8-FP8", method="gptq", awq=True,
                 rotate="hadamard", mse=True, static=True)
    assert m.steps() == (Rotate(), SmoothQuant(0.5), AWQ(), OverrideWorst(0.05, "w8a8-fp8"), StaticScales(),
                         MSEScales(), GPTQ())
    assert Measures().steps() == ()
    for name, best in BEST.items():
        assert best_steps(name.upper()) is best and all(isinstance(s, Step) for s in best.steps)
        QuantizeJob.build(name, best.steps)          # every best list is a valid job


# ------------------------------------------------------------------ the library writes the CLI's bytes
def _dense(rng):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    return transformers.LlamaForCausalLM(cfg).eval()


def _hashes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.suffix == ".safetensors" or p.name == "config.json"}


@pytest.mark.parametrize("kind, flags, job", [
    ("dense", ["--recipe", "w8a8-int8", "--kv-cache", "fp8"],          # the best measures: SmoothQuant + sites
     lambda: QuantizeJob.build("w8a8-int8", BEST["w8a8-int8"].steps, kv_cache="fp8")),
    ("moe", ["--recipe", "w4a16-g32", "--awq", "--gptq", "--ignore", "model.layers.0.mlp.experts"],
     lambda: QuantizeJob.build("w4a16-g32", [AWQ(), GPTQ()], ignore=["model.layers.0.mlp.experts"])),
])
def test_library_checkpoint_is_the_clis_byte_for_byte(rng, monkeypatch, tmp_path, kind, flags, job):
    model = _dense(rng) if kind == "dense" else tiny_moe("mixtral", rng, dtype=torch.float32, experts=4)
    ids = torch.randint(0, 97, (192,), generator=rng)
    texts = workload.Texts(ids[:64], [ids[None, :64], ids[None, 64:128]], [ids[None, -64:]])
    loaded = workload.Loaded(f"tiny-{kind}", model, None, "causal")
    monkeypatch.setattr(workload, "load_model", lambda spec: loaded)
    monkeypatch.setattr(workload, "prepare_texts", lambda *a, **k: texts)
    cli, folder = tmp_path / "cli", tmp_path / "tiny"     # --model names a model folder, checked before loading
    model.save_pretrained(folder)
    save_tokenizer(folder)
    assert main(["quantize", "--model", str(folder), "--tokens", "64", "--calib-tokens", "64", "--window", "64",
                 "--no-eval", "--out", str(cli), *flags]) == 0
    run = quantize_job(loaded, texts, job(), window=64, evaluate=False, progress=False)
    lib = save_compressed(run.model, tmp_path / "lib", run.summary.recipes[run.recipe], dtype=torch.float32)
    want = _hashes(cli)
    assert "model.safetensors" in want and _hashes(lib) == want
    # the session (what the CLI calls) used directly, its lines collected instead of printed
    lines = []
    session = QuantizeSession.load(str(folder), say=lines.append)
    session.prepare(TextOptions(tokens=64, calib_tokens=64, window=64), dtype="float32", evaluate=False)
    result = session.quantize(job(), sites=False, estimated=False)
    session.write(result, tmp_path / "session")
    assert _hashes(tmp_path / "session") == want
    assert (tmp_path / "session" / "lowbit_report.md").is_file() and result.saved
    assert lines[0] == f"loading {folder} ..." and lines[-1] == f"checkpoint: {tmp_path / 'session'}"
    assert "not evaluated" in result.line()


def test_steps_compute_what_the_algorithms_compute_one_by_one(rng, tmp_path):
    """SmoothQuant, the worst sites by block SQNR, static scales, then the quantization: the job's
    steps against the algorithms called directly in that order, the checkpoints byte for byte."""
    from lowbit.algorithms.smoothquant import smooth_model
    from lowbit.algorithms.static_scales import calibrate_static_scales
    from lowbit.diagnosis.sites import pick_overrides, site_report
    from lowbit.pipelines.quantize_model import quantize_model
    from lowbit.recipes.plan import linear_layers
    from lowbit.recipes.presets import RECIPES
    model = _dense(rng)
    ids = torch.randint(0, 97, (128,), generator=rng)
    texts = workload.Texts(ids[:64], [ids[None, :64]], [ids[None, -64:]])
    job = QuantizeJob.build("w8a8-int8", [StaticScales(), OverrideWorst(0.1), SmoothQuant(0.5)])
    run = quantize_job(workload.Loaded("t", model, None, "causal"), texts, job, evaluate=False, sites=False,
                       progress=False)
    m, r = copy.deepcopy(model), RECIPES["w8a8-int8"]
    smooth_model(m, texts.calib, alpha=0.5)
    picked = pick_overrides(site_report(m, texts.calib, r), len(linear_layers(m)), 0.1)
    assert picked and picked == run.overrides
    scales = calibrate_static_scales(m, texts.calib, r.act)
    quantize_model(m, r, overrides=picked, act_static_scales=scales)
    job_dir = save_compressed(run.model, tmp_path / "job", r, dtype=torch.float32)
    want = _hashes(save_compressed(m, tmp_path / "direct", r, dtype=torch.float32))
    assert "model.safetensors" in want and _hashes(job_dir) == want


@pytest.mark.parametrize("n_linear, fraction, by, sites", [(210, 0.05, "block", 10), (211, 0.05, "kl", 10),
                                                           (14, 0.05, "block", 0), (40, 0.05, "block", 2),
                                                           (19, 0.05, "kl", 0), (20, 0.05, "block", 1)])
def test_the_site_pick_is_counted_on_this_model(n_linear, fraction, by, sites):
    """The best-measures line counts the sites the pick keeps on the model at hand (a fraction of a
    small model's Linears can be no site at all), by hand: floor(fraction * n_linear)."""
    text = step_text(OverrideWorst(fraction, by=by), n_linear)
    if sites == 0:
        assert text == f"no site kept in high precision ({fraction:.0%} of this model's {n_linear} Linears is 0 sites)"
    else:
        how = "by measured next-token KL" if by == "kl" else "by block SQNR"
        assert text == (f"the {sites} worst sites {how} kept in high precision ({fraction:.0%} of this model's "
                        f"{n_linear} Linears)")


def test_the_best_line_claims_no_smollm2_figure_for_another_model():
    for recipe, best in BEST.items():
        line = best_line(recipe, best, 14, 2048)
        assert line.startswith(f"{recipe}: applying the measures that measured best on SmolLM2-135M")
        assert "%" not in line.split("):", 1)[1].replace("% of this model's", "")   # no perplexity figure
        assert "2048 calibration tokens" in line
