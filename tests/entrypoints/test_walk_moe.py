"""A new user's walk through `lowbit quantize` on mixture-of-experts models: `--ignore` naming an
experts module (as docs/moe.md says it may), a recipe whose group does not divide the experts' K
(refused before calibration, with --no-save too, in the CLI's own flags), gpt-oss refused before
calibration when it cannot be saved, and the routing report with some experts kept in float."""
import pytest
import torch

from lowbit.entrypoints.main import main
from lowbit.io.st_format import checkpoint_files, read_header
from moe_fixtures import tiny_moe
from cli_fixtures import no_texts
from cli_fixtures import one_line_error as _one_line_error

transformers = pytest.importorskip("transformers")


def one_line_error(capsys, *words):
    return _one_line_error(capsys, *words, prefix="lowbit quantize: error:")


ARGS = ["--tokens", "64", "--calib-tokens", "32", "--window", "32", "--plain", "--no-eval"]


@pytest.fixture
def moe(monkeypatch, rng):
    """Returns make(family): `lowbit quantize` then runs on a tiny random model of that family
    (4 experts, H = I = 64) and random token windows."""
    from lowbit.evaluation import workload

    def make(family):
        model = tiny_moe(family, rng, dtype=torch.float32, experts=4)
        ids = torch.randint(0, 97, (192,), generator=rng)
        monkeypatch.setattr(workload, "load_model", lambda spec: workload.Loaded(f"tiny-{family}", model, None,
                                                                                 "causal"))
        monkeypatch.setattr(workload, "prepare_texts", lambda loaded, tokens, calib, window, **d: workload.Texts(
            ids[:tokens], [ids[None, :window]], [ids[None, -window:]]))
        return model
    return make


def test_ignore_naming_an_experts_module_is_accepted_and_saved_in_float(moe, tmp_path, capsys):
    moe("mixtral")
    out = tmp_path / "o"
    assert main(["quantize", *ARGS, "--recipe", "w4a16-g32", "--ignore", "model.layers.0.mlp.experts",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 of 2 experts modules quantized" in printed
    assert "model.layers.0.mlp.experts: skipped (ignore pattern 'model.layers.0.mlp.experts')" in printed
    header = {}
    for f in set(checkpoint_files(out).values()):
        header.update(read_header(f)[0])     # name -> (dtype, shape, begin, end)
    for p in ("w1", "w2", "w3"):     # layer 0's experts in float, layer 1's packed int4
        assert header[f"model.layers.0.block_sparse_moe.experts.2.{p}.weight"][0] == torch.float32
        assert f"model.layers.1.block_sparse_moe.experts.2.{p}.weight_packed" in header
    md = (out / "lowbit_report.md").read_text()
    # the kept layer's routing is still reported (its flips come from the layers before it)
    assert "| model.layers.0.mlp.experts |" in md and "kept in high precision" in md


def test_a_misspelt_experts_pattern_is_still_refused(moe, monkeypatch, tmp_path, capsys):
    moe("mixtral")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--ignore", "model.layers.0.mlp.expertz",
                 "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "'model.layers.0.mlp.expertz'", "matches no")


@pytest.mark.parametrize("save", [True, False])
def test_experts_group_not_dividing_k_refused_before_calibration(moe, monkeypatch, tmp_path, capsys, save):
    """H = I = 64 under w4a16's groups of 128: refused before any calibration, in the CLI's flags,
    naming the recipe that fits, saved or not (experts take whole groups only)."""
    moe("qwen3_moe")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    argv = ["quantize", *ARGS, "--recipe", "w4a16", "--out", str(tmp_path / "o")]
    assert main(argv + ([] if save else ["--no-save"])) == 2
    last = one_line_error(capsys, "--recipe w4a16", "w4a16-g32")
    if not save:
        assert "--ignore 'model.layers.*.mlp.experts'" in last and "ignore=[" not in last


def test_gpt_oss_refused_before_calibration_when_saving_then_saved_with_its_experts_ignored(
        moe, monkeypatch, tmp_path, capsys):
    moe("gpt_oss")
    from lowbit.evaluation import workload
    texts = workload.prepare_texts
    monkeypatch.setattr(workload, "prepare_texts", no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--out", str(tmp_path / "a")]) == 2
    one_line_error(capsys, "--recipe w8a8-int8", "gpt_oss", "--ignore 'model.layers.*.mlp.experts'", "--no-save")
    monkeypatch.setattr(workload, "prepare_texts", texts)
    out = tmp_path / "b"
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--ignore", "model.layers.*.mlp.experts",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "0 of 2 experts modules quantized" in printed and (out / "config.json").is_file()
    assert "MoE routing" not in (out / "lowbit_report.md").read_text()    # no experts quantized: no routing report


# ------------------------------------------------------------------ KV cache, help texts, --sequential
def test_grouped_kv_cache_that_does_not_divide_head_dim_refused_before_calibration(tiny, monkeypatch, tmp_path,
                                                                                 capsys):
    """The tiny Llama has head_dim 16: int4-g32 used to fail at the first evaluation, after the
    whole quantization, with no flag named; now right after loading, naming groups that fit."""
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    for extra in ([], ["--no-save"]):
        assert main([*tiny, "--plain", "--kv-cache", "int4-g32", "--out", str(tmp_path / "o"), *extra]) == 2
        one_line_error(capsys, "--kv-cache int4-g32", "head_dim 16", "--kv-cache int4-g16")


def test_attention_sites_say_high_precision_not_none(tiny, tmp_path, capsys):
    assert main([*tiny, "--plain", "--kv-cache", "int8-token", "--no-save", "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    assert "attention sites (KV int8 token; Q high precision, P high precision)" in printed
    assert "None" not in printed
    # P is not quantized: its column says so instead of float64 rounding's ~300 dB
    rows = [ln for ln in printed.splitlines() if ln.startswith("| 0 |") or ln.startswith("| 1 |")]
    assert rows and all("| - (not quantized) |" in ln for ln in rows), rows


def test_help_names_the_moe_families_and_every_grouped_kv_cache(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3" in text        # --sequential
    assert "int4-g64" in text and "int4-g128" in text               # --kv-cache
    assert "MoE experts modules" in text                           # --ignore / --override


def test_sequential_prints_gptq_per_expert_and_ignored_experts(rng, tmp_path, capsys, monkeypatch):
    from lowbit.workflows import sequential as wf_sequential
    d = tmp_path / "float"
    tiny_moe("qwen3_moe", rng, dtype=torch.float32, experts=4).save_pretrained(d)
    ids = torch.randint(0, 97, (64,), generator=rng)
    monkeypatch.setattr(wf_sequential, "calibration_windows", lambda m, tokens, window: [ids[None, :32], ids[None, 32:]])
    assert main(["quantize", "--model", str(d), "--sequential", "--gptq", "--recipe", "w4a16-g32", "--calib-tokens",
                 "64", "--window", "32", "--ignore", "model.layers.0.mlp.experts", "--out", str(tmp_path / "q"),
                 "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  model.layers.0.mlp.experts: skipped (ignore pattern 'model.layers.0.mlp.experts')" in lines
    assert any(ln.startswith("  model.layers.1.mlp.experts: GPTQ on ") for ln in lines), lines


def test_sequential_refusal_does_not_offer_no_save(rng, tmp_path, capsys):
    """--sequential refuses --no-save: the K-by-group refusal must not offer it as the way out."""
    d = tmp_path / "float"
    tiny_moe("qwen3_moe", rng, dtype=torch.float32, experts=4).save_pretrained(d)
    assert main(["quantize", "--model", str(d), "--sequential", "--recipe", "w4a16", "--out", str(tmp_path / "q"),
                 "--device", "cpu"]) == 2
    last = one_line_error(capsys, "--recipe w4a16", "w4a16-g32")
    assert "--no-save" not in last


def test_site_plot_of_a_weight_only_recipe_warns_nothing(tiny, tmp_path, recwarn):
    assert main([*tiny, "--plain", "--recipe", "w4a16-g32", "--no-save", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "lowbit_sites.png").stat().st_size > 0
    assert not [w for w in recwarn if "legend" in str(w.message)]


@pytest.mark.parametrize("fold", ["smoothquant", "awq"])
def test_routing_report_weight_sqnr_is_against_the_folded_weights(rng, fold):
    """After SmoothQuant / AWQ on the experts' down side, the quantized down weights are of
    W * s per column: against the unfolded float weights their 'SQNR' measured the fold, not the
    quantization (13 dB for w8a8-int8, 44 dB plain on a tiny Mixtral). The oracle folds a copy
    itself (the same deterministic fold) and measures 10 log10(|W|^2 / |W - Q|^2) per expert."""
    import copy
    from lowbit.algorithms.experts_fold import awq_experts, smooth_experts
    from lowbit.archs.experts import find_experts
    from lowbit.workflows.job import QuantizeJob
    from lowbit.workflows.quantize import quantize_job
    from lowbit.workflows.steps import AWQ, SmoothQuant
    from lowbit.evaluation import workload
    from lowbit.nn.experts import _as_enk
    model = tiny_moe("mixtral", rng, dtype=torch.float32, experts=4)
    ids = torch.randint(0, 97, (256,), generator=rng)
    calib = [ids[None, :128], ids[None, 128:]]
    texts = workload.Texts(ids[:64], calib, [ids[None, -32:]])
    loaded = workload.Loaded("tiny-mixtral", model, None, "causal")
    recipe = "w8a8-int8" if fold == "smoothquant" else "w4a16-g32"
    job = QuantizeJob.build(recipe, [SmoothQuant(0.5) if fold == "smoothquant" else AWQ()])
    run_ = quantize_job(loaded, texts, job, evaluate=False, sites=False, progress=False)
    folded = copy.deepcopy(model)
    smooth_experts(folded, calib, alpha=0.5) if fold == "smoothquant" else awq_experts(folded, recipe, calib)
    assert run_.experts_weight_db is not None
    for name, spec in find_experts(model).items():
        q = run_.model.get_submodule(name)
        for proj, attr in zip(("gate_up", "down"), spec.weights):
            w = _as_enk(getattr(folded.get_submodule(name), attr).detach(), spec.layout).double()
            for e in range(q.num_experts):
                d = q.weight_q(proj, e).dequantize(torch.float64)
                want = 10 * torch.log10(w[e].square().sum() / (w[e] - d).square().sum())
                # float64 sums of the same numbers in another order: 1e-6 dB is far below any rounding
                # that matters, far above float64's reassociation error (~1e-13 relative)
                assert abs(run_.experts_weight_db[name][proj][e] - float(want)) < 1e-6, (name, proj, e)
        # the fold moved the down weights: the unfolded comparison would have differed
        wf = _as_enk(getattr(model.get_submodule(name), spec.down).detach(), spec.layout).double()
        assert not torch.equal(wf, _as_enk(getattr(folded.get_submodule(name), spec.down).detach(),
                                           spec.layout).double())


def test_quantize_smoothquant_report_weight_sqnr_meets_the_int8_bound(moe, tmp_path, capsys):
    """w8a8-int8 weights, one scale per output row: every element's error is at most amax/254 of
    its row and the row holds at least amax^2, so SQNR >= 10 log10(254^2 / K) = 30.1 dB at K = 64
    (H = I = 64 here), whatever fold came before. Measured against the unfolded weights it read
    about 13 dB."""
    import math
    moe("mixtral")
    out = tmp_path / "o"
    # 128 calibration tokens, top-2 of 4 experts: 64 routed per expert on average, so most experts
    # pass the fold's 32-token minimum and are folded
    assert main(["quantize", "--tokens", "128", "--calib-tokens", "128", "--window", "128", "--no-eval", "--no-save",
                 "--recipe", "w8a8-int8", "--smoothquant", "0.5", "--out", str(out)]) == 0
    rows = [ln for ln in (out / "lowbit_report.md").read_text().splitlines() if ln.startswith("| model.layers.")
            and ".experts |" in ln]
    assert len(rows) == 2
    bound = 10 * math.log10(254 ** 2 / 64)
    for ln in rows:
        weight_db = float(ln.split("|")[6])
        assert weight_db >= bound, ln


def test_rotate_on_a_moe_family_names_the_flag(moe, tmp_path, capsys):
    moe("mixtral")
    assert main(["quantize", "--tokens", "64", "--calib-tokens", "32", "--window", "32", "--no-eval", "--no-save",
                 "--recipe", "w8a8-int8", "--rotate", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--rotate hadamard refused", "MixtralForCausalLM", "without --rotate")


@pytest.mark.parametrize("no_save", [True, False])
def test_a_foreign_routing_png_in_out_is_refused_before_loading(monkeypatch, tmp_path, capsys, no_save):
    """--overwrite adds lowbit's files and replaces none of the user's: lowbit_routing.png (the
    MoE routing plot) is one of lowbit's names, so a user's file of that name is refused up front,
    not after the whole run."""
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    out = tmp_path / "o"
    out.mkdir()
    (out / "lowbit_routing.png").write_bytes(b"mine")
    argv = ["quantize", *ARGS, "--recipe", "w8a8-int8", "--overwrite", "--out", str(out)]
    assert main(argv + (["--no-save"] if no_save else [])) == 2
    one_line_error(capsys, "lowbit_routing.png")
    assert (out / "lowbit_routing.png").read_bytes() == b"mine"


def test_static_scales_on_moe_experts_refused_before_calibration(moe, monkeypatch, tmp_path, capsys):
    moe("mixtral")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    # --static-scales is a measure flag: no --plain beside it
    assert main(["quantize", *[a for a in ARGS if a != "--plain"], "--recipe", "w8a8-int8", "--static-scales",
                 "--no-save",
                 "--out", str(tmp_path / "o")]) == 2
    last = one_line_error(capsys, "--static-scales", "MoE experts", "--ignore 'model.layers.*.mlp.experts'")
    assert "act_static_scales" not in last


def test_routing_markdown_says_when_no_token_flipped():
    """'each is listed below' followed by nothing read like a missing list."""
    from lowbit.diagnosis.routing_report import Flip, LayerRouting, RoutingReport
    layer = LayerRouting("r", "model.layers.0.mlp.experts", 8, [], 0, [4, 4, 8], [4, 4, 8])
    md = RoutingReport([layer], "weight int8").to_markdown()
    assert "- no token's top-k expert set changed (router high precision)" in md
    layer.flips = [Flip(0, 0, 3, (0, 2), (1, 2))]
    md = RoutingReport([layer], "weight int8").to_markdown()
    assert "no token's top-k" not in md and "position 3: [0, 2] -> [1, 2]" in md


def test_kv_cache_on_multi_head_latent_attention_refused_before_calibration(moe, monkeypatch, tmp_path, capsys):
    """DeepSeek-V3's attention has no k_proj / v_proj: refused right after loading, naming the flag;
    it used to fail after the per-site calibration, asking whether the model was an encoder."""
    moe("deepseek_v3")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w8a8-int8", "--kv-cache", "fp8-head", "--no-save",
                 "--out", str(tmp_path / "o")]) == 2
    last = one_line_error(capsys, "--kv-cache fp8-head", "DeepseekV3ForCausalLM", "drop --kv-cache")
    assert "an encoder?" not in last


def test_an_override_whose_group_does_not_fit_the_experts_is_named_with_its_pattern(moe, monkeypatch, tmp_path,
                                                                                      capsys):
    moe("mixtral")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    assert main(["quantize", *ARGS, "--recipe", "w4a16-g32", "--override", "model.layers.0.mlp.experts=w4a16",
                 "--no-save", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--override model.layers.0.mlp.experts=w4a16:", "use w4a16-g32")


def test_distributed_without_torchrun_is_a_one_line_error_before_loading(monkeypatch, tmp_path, capsys):
    from lowbit.algorithms import distributed as D
    for k in D._ENV:
        monkeypatch.delenv(k, raising=False)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before --distributed was checked")
    monkeypatch.setattr("lowbit.evaluation.workload.load_model", no_model)
    assert main(["quantize", *ARGS, "--distributed", "--no-save", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--distributed", "torchrun --nproc-per-node N -m lowbit quantize")


def test_sites_on_moe_with_a_group_that_does_not_fit_the_experts_reports_the_linears(moe, tmp_path, capsys):
    """The per-site report of the Linears still comes; the routing section says why it is absent
    (it used to fail after the sites with quantize_model's ignore=[...] advice, a flag sites lacks)."""
    moe("mixtral")
    png = tmp_path / "s.png"
    assert main(["sites", "--tokens", "64", "--window", "32", "--recipe", "w4a16", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "== MoE routing, w4a16: not reported:" in out and "use w4a16-g32" in out and "--ignore" not in out
    assert png.stat().st_size > 0 and not (tmp_path / "s_routing.png").exists()


def test_sites_smoothquant_on_moe_refused_before_any_site(moe, monkeypatch, tmp_path, capsys):
    moe("mixtral")
    monkeypatch.setattr("lowbit.evaluation.workload.prepare_texts", no_texts)
    assert main(["sites", "--tokens", "64", "--window", "32", "--smoothquant", "--png", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("lowbit sites: error: --smoothquant"), err


def test_moe_without_plain_says_the_dense_defaults_do_not_apply_and_runs_plain(moe, tmp_path, capsys):
    """The best measured measures (SmoothQuant and overridden sites for w8a8-int8) were measured on
    a dense decoder: on an MoE model without --plain the CLI says so and writes what --plain writes,
    bit for bit."""
    from lowbit.io.st_format import TensorReader
    moe("mixtral")
    outs = {}
    for name, extra in (("default", []), ("plain", ["--plain"])):
        outs[name] = tmp_path / name
        args = [a for a in ARGS if a != "--plain"] + extra
        assert main(["quantize", *args, "--recipe", "w8a8-int8", "--out", str(outs[name])]) == 0
        printed = capsys.readouterr().out
        if name == "default":
            assert "were measured on a dense decoder, not on MoE experts; plain round to nearest" in printed
            assert "applying the measures that measured best" not in printed
    files = {k: checkpoint_files(d) for k, d in outs.items()}
    assert sorted(files["default"]) == sorted(files["plain"])
    for n in files["default"]:
        with TensorReader(files["default"][n]) as a, TensorReader(files["plain"][n]) as b:
            x, y = a.get(n), b.get(n)
            assert x.dtype == y.dtype and torch.equal(x, y), n
