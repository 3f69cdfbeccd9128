"""`lowbit bench model` on MoE shapes, on the CPU at tiny sizes: the whole path the H200 run takes
(transformers' expert loop and the torch._grouped_mm baseline, lowbit recipes on their exact
path, the JSON, the table, the PNG), the expert bytes against the tensors the modules hold, the
ratios and the must verdicts, and the grouped baseline against transformers' loop in float64.
CPU timings mean nothing and are not asserted; the GPU run is `bash scripts/gpu.sh moe`."""
import copy
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from lowbit.bench import moe_model, moe_report  # noqa: E402
from lowbit.entrypoints.main import main  # noqa: E402

RECIPES = ("w4a16", "w8a8-int8")
BATCHES = (1, 3)
HAS_GROUPED = moe_model.grouped_mm_op() is not None


def _bytes(tensors) -> int:
    """Bytes of distinct storages."""
    seen = {}
    for t in tensors:
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _run(tmp_path, shape: str, seed: int, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "moe.json"
    rc = main(["bench", "model", "--device", "cpu", "--shape", shape, "--layers", "1", "--recipes", ",".join(RECIPES),
               "--no-compile", "--quick", "--prefill", "37", "--context", "21", "--batches",
               ",".join(map(str, BATCHES)), "--error-tokens", "29", "--seed", str(seed),
               "--budget", "3600",  # a busy CPU must not skip steps
               "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("shape", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_rows_bytes_ratios_and_musts(tmp_path, rng, capsys, shape):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    rc, run = _run(tmp_path, shape, seed, "--plot", str(tmp_path / "moe.png"))
    assert rc == 0
    env = run["environment"]
    assert env["moe_shape"] == moe_model.SHAPES[shape] and env["torch_grouped_mm"] == HAS_GROUPED
    rows = run["rows"]
    variants = ("bf16", "bf16-grouped", *RECIPES)
    want = {(v, "eager", p, b) for v in variants for p, b in [("prefill", 1)] + [("decode", b) for b in BATCHES]}
    assert sorted((r["variant"], r["mode"], r["phase"], r["batch"]) for r in rows) == sorted(want)
    kinds = {"bf16": "baseline", "bf16-grouped": "grouped", **{v: "lowbit" for v in RECIPES}}
    by = {(r["variant"], r["phase"], r["batch"]): r for r in rows}
    for r in rows:
        assert r["kind"] == kinds[r["variant"]]
        if r["kind"] == "grouped" and not HAS_GROUPED:
            assert r["ms"] is None and r["skipped"].startswith("n/a: torch")
            continue
        assert not r.get("error") and not r.get("skipped"), r
        assert r["ms"] > 0 and r["tokens"] == (37 if r["phase"] == "prefill" else r["batch"])
        loop, grouped = by[("bf16", r["phase"], r["batch"])], by[("bf16-grouped", r["phase"], r["batch"])]
        assert r["vs_loop"] == loop["ms"] / r["ms"] and r["speedup"] == r["vs_loop"]
        if HAS_GROUPED:
            assert r["vs_grouped"] == grouped["ms"] / r["ms"]
    assert by[("bf16", "prefill", 1)]["experts_impl"] == "eager"   # transformers' loop, asked for by name

    # expert bytes from the tensors themselves: bf16 [E, 2I, H] + [E, H, I] per layer; each
    # recipe's QuantExperts buffers (codes, scales, packed copies), built here independently
    cfg = moe_model.SHAPES[shape]
    E = cfg.get("num_local_experts", cfg.get("num_experts"))
    H, I = cfg["hidden_size"], cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    base = by[("bf16", "prefill", 1)]
    assert base["expert_bytes"] == E * (2 * I * H + H * I) * 2
    assert base["weight_bytes"] > base["expert_bytes"]
    if HAS_GROUPED:   # the grouped baseline holds the same parameters, no copy
        assert by[("bf16-grouped", "prefill", 1)]["expert_bytes"] == base["expert_bytes"]
    from lowbit.nn import QuantExperts
    from lowbit.pipelines.quantize_model import quantize_model
    for recipe in RECIPES:
        model = moe_model.build_moe(shape, 1, torch.bfloat16, "cpu", seed)
        quantize_model(model, recipe)
        qe = [m for m in model.modules() if isinstance(m, QuantExperts)]
        assert len(qe) == 1
        held = _bytes(b for m in qe for b in m.buffers())
        r = by[(recipe, "prefill", 1)]
        assert r["expert_bytes"] == held
        assert r["expert_ratio"] == held / base["expert_bytes"]
        code_bytes = E * 3 * I * H * (0.5 if recipe == "w4a16" else 1)   # at least the codes themselves
        assert code_bytes <= held < base["expert_bytes"]
        assert r["expert_weight"] and r["logits_rel_err"] > 0 and math.isfinite(r["logits_rel_err"])
        # each row names its experts' path: the exact one on the CPU; on the kernel path (as on a GPU)
        # the weight-only experts take the bf16 path at prefill's sorted rows (37 x top_k >= 65)
        assert all(by[(recipe, p, b)]["expert_paths"] == {"exact": 1} for p, b in [("prefill", 1)] + [
            ("decode", b) for b in BATCHES])
        qe[0].backend = "kernel"
        kind = qe[0].kernel
        prefill = "dequant" if recipe == "w4a16" else "kernel"
        assert moe_model.expert_paths(model, 37, torch.bfloat16, torch.device("cpu")) == {f"{prefill}:{kind}": 1}
        assert moe_model.expert_paths(model, 1, torch.bfloat16, torch.device("cpu")) == {f"kernel:{kind}": 1}
        # the must verdicts follow the measured ratios
        met = r["expert_ratio"] <= (0.30 if recipe == "w4a16" else 0.55)
        assert r["must_memory"] == f"experts <= {0.30 if recipe == 'w4a16' else 0.55:.2f}x bf16"
        assert r["must_memory_met"] is met
        for b in BATCHES:
            d = by[(recipe, "decode", b)]
            target = 2.0 if recipe == "w4a16" else 1.3
            assert d["must_speed"] == f">= {target:.1f}x bf16-grouped"
            assert d["must_speed_met"] is ((d["vs_grouped"] >= target) if HAS_GROUPED else None)
        assert ("must_speed" in r) == (recipe == "w8a8-int8")        # prefill: a W8A8 target only
    assert "must_speed" not in base and "must_memory" not in base
    printed = capsys.readouterr().out
    table = printed[printed.index("# lowbit bench model"):]
    assert all(v in table for v in variants) and "must targets:" in table and "w4a16 expert weights" in table
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "moe.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert "# no plot" in printed
    # the report redraws from the JSON alone
    assert moe_report.main([str(tmp_path / "moe.json")]) == 0
    assert "must targets:" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_GROUPED, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("shape", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_grouped_baseline_matches_transformers_loop(rng, shape):
    """GroupedMMExperts in float32 against transformers' own expert loop in float64 (an
    independent oracle), elementwise, within a bound derived from float32 rounding
    (u = 2^-24, gamma_n = n u / (1 - n u), the dot-product bound |fl(a.b) - a.b| <= gamma_n |a|.|b|):
      h = x W1^T                 |dh| <= gamma_H |x| |W1|^T
      g = silu(gate) * up        |dg| <= 1.1 |dgate| |up| + |silu(gate)| |dup| + 8u |g|
                                 (silu' <= 1.0999; exp, add, divide, multiply: <= 2u each)
      y = g W2^T                 |dy| <= |dg| |W2|^T + gamma_I (|g| + |dg|) |W2|^T
      out = sum_j w_j y_j        |dout| <= sum_j |w_j| |dy_j| + gamma_{k+1} sum_j |w_j y_j|
    The float64 reference's own error is 2^-29 times smaller; the bound is doubled for it and
    for the second-order terms. Routings with an empty expert and a hot one; a permutation bug
    (outputs returned to the wrong tokens) or gate / up swapped are far outside."""
    model = moe_model.build_moe(shape, 1, torch.float64, "cpu", int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    loop = moe_model.expert_names(model)[0]
    ref_mod = model.get_submodule(loop)
    E, N2, H = ref_mod.gate_up_proj.shape
    I = N2 // 2
    k = moe_model.SHAPES[shape]["num_experts_per_tok"]
    T = 29
    # routing: top-k distinct experts per token, expert E-1 never chosen, expert 0 in every token
    idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(E - 2, generator=rng)[:k - 1]])
                       for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=rng, dtype=torch.float64), -1)
    x = torch.randn(T, H, generator=rng, dtype=torch.float64)
    with torch.no_grad():
        ref = ref_mod(x, idx, w)
        f32 = moe_model.GroupedMMExperts(copy.deepcopy(ref_mod)).float()   # shares parameters: a copy
        got = f32(x.float(), idx, w.float()).double()
    u = 2.0 ** -24
    gam = lambda n: n * u / (1 - n * u)  # noqa: E731
    W1, W2 = ref_mod.gate_up_proj.detach(), ref_mod.down_proj.detach()
    bound = torch.zeros(T, H, dtype=torch.float64)
    for j in range(k):
        e = idx[:, j]
        h = torch.einsum("th,tnh->tn", x, W1[e])
        dh = gam(H) * torch.einsum("th,tnh->tn", x.abs(), W1[e].abs())
        gate, up = h[:, :I], h[:, I:]
        silu = torch.nn.functional.silu(gate)
        g = silu * up
        dg = 1.1 * dh[:, :I] * up.abs() + silu.abs() * dh[:, I:] + 8 * u * g.abs()
        W2a = W2[e].abs()
        y = torch.einsum("ti,thi->th", g, W2[e])
        dy = torch.einsum("ti,thi->th", dg, W2a) + gam(I) * torch.einsum("ti,thi->th", g.abs() + dg, W2a)
        bound += w[:, j, None] * dy + gam(k + 1) * (w[:, j, None] * y).abs()
    err = (got - ref).abs()
    assert (err <= 2 * bound).all(), float((err / bound).max())
    assert float(err.max()) > 0 or float(bound.max()) > 0
    # the oracle is sharp: the outputs of two tokens swapped are far outside the bound
    assert not ((got[[1, 0, *range(2, T)]] - ref).abs() <= 2 * bound).all()


@pytest.mark.skipif(not HAS_GROUPED, reason="this torch has no torch._grouped_mm")
def test_grouped_baseline_compiles_whole(rng):
    """No host synchronisation: dynamo captures GroupedMMExperts in one graph (fullgraph=True
    raises on a break), so torch.compile and CUDA graphs take it whole on the GPU; the graph
    computes what eager computes (same aten ops: bit-identical). bf16: torch's meta function of
    _grouped_mm (what the compiler traces) accepts bf16 only."""
    model = moe_model.build_moe("tiny-qwen3-moe", 1, torch.bfloat16, "cpu", 0)
    mod = moe_model.GroupedMMExperts(model.get_submodule(moe_model.expert_names(model)[0]))
    T, k, E = 13, 4, mod.num_experts
    idx = torch.stack([torch.randperm(E, generator=rng)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=rng).bfloat16()
    x = torch.randn(T, mod.gate_up_proj.shape[2], generator=rng).bfloat16()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(mod, backend="aot_eager", fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x, idx, w), mod(x, idx, w))
    torch._dynamo.reset()


def test_untimed_exact_experts_and_grouped_na(monkeypatch):
    """On CUDA a recipe whose experts have no grouped kernel would run the float64 exact path:
    its rows are skipped and say so (never minutes of timing a reference); a torch without
    torch._grouped_mm makes the grouped baseline's rows n/a and the speed musts n/a, not missed;
    the loop's compiled rows obey --loop-budget while its eager rows always run."""
    from lowbit.bench import model as bm
    from lowbit.pipelines.quantize_model import quantize_model

    m = moe_model.build_moe("tiny-mixtral", 1, torch.float32, "cpu", 0)
    names = moe_model.expert_names(m)        # the float model's (QuantExperts are not listed)
    assert names == ["model.layers.0.mlp.experts"]
    quantize_model(m, "w8a16-int8")          # every experts recipe has a grouped kernel
    assert moe_model.untimed_experts(m, torch.device("cuda")) == []
    experts = m.get_submodule(names[0])
    experts.kernel = None                    # as a recipe without one would be
    assert moe_model.untimed_experts(m, torch.device("cpu")) == []
    assert moe_model.untimed_experts(m, torch.device("cuda")) == names

    monkeypatch.setattr(moe_model, "grouped_mm_op", lambda: None)
    real = moe_model.untimed_experts

    def no_kernel(model, dev):               # the variant's experts lose their kernel, as above
        for mod in model.modules():
            if hasattr(mod, "kernel") and type(mod).__name__ == "QuantExperts":
                mod.kernel = None
        return real(model, torch.device("cuda"))
    monkeypatch.setattr(moe_model, "untimed_experts", no_kernel)
    opts = bm.Options(shape="tiny-mixtral", layers=1, dtype="fp32", device="cpu", modes=("eager", "compile"),
                      compile_backend="aot_eager", prefill=9, context=7,
                      batches=(1, 2), error_tokens=5, quick=True, budget=3600.0, loop_budget=0.0,
                      variants=("w8a16-int8",), log=lambda msg: None)
    rows = bm.run_bench(opts)
    by = {(r["variant"], r["mode"], r["phase"], r["batch"]): r for r in rows}
    for p, b in (("prefill", 1), ("decode", 1), ("decode", 2)):
        assert by[("fp32", "eager", p, b)]["ms"] > 0
        assert by[("fp32", "compile", p, b)]["skipped"].startswith("not run: --loop-budget 0")
        for mode in ("eager", "compile"):
            assert by[("fp32-grouped", mode, p, b)]["skipped"].startswith("n/a: torch")
            r = by[("w8a16-int8", mode, p, b)]
            assert r["ms"] is None and "exact float64 path" in r["skipped"], r
    table = moe_report.table(rows)
    assert "n/a" in table and "w8a16-int8 expert weights" in table


def test_must_verdicts_n_a_without_a_grouped_row():
    r = dict(name="w4a16 eager decode b1", variant="w4a16", kind="lowbit", mode="eager", phase="decode", batch=1,
             ms=1.0)
    moe_report.add_moe_ratios([r])
    assert r["must_speed_met"] is None and moe_report.verdict(None) == "n/a"
    assert r["must_memory_met"] is None       # no bf16 expert bytes to compare with


def test_moe_bad_input(capsys):
    assert main(["bench", "model", "--device", "cpu", "--shape", "tiny-mixtral", "--recipes", "torchao-int8"]) == 2
    err = capsys.readouterr().err
    assert "recipes=torchao-int8" in err and "MoE shape" in err
    with pytest.raises(ValueError, match="not a MoE shape"):
        moe_model.build_moe("8b", 1, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="layers=0"):
        moe_model.build_moe("tiny-mixtral", 0, torch.float32, "cpu", 0)
