"""`lowbit bench model` on the CPU at the tiny shape: the rows' structure, the weight-byte count,
the logits' relative error of a recipe against a bound derived from int8 rounding, and the
decode step (KV cache filled, one token, rewound) against a full forward pass. CPU timings are
not asserted (they mean nothing); the GPU run is `bash scripts/gpu.sh model`."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from lowbit.bench import llama  # noqa: E402
from lowbit.bench.model_measure import resident_bytes  # noqa: E402
from lowbit.entrypoints.main import main  # noqa: E402

U64 = 2.0 ** -53
H, I, LAYERS = llama.SHAPES["tiny"]["hidden_size"], llama.SHAPES["tiny"]["intermediate_size"], 2
RECIPES = ("w8a8-int8", "w4a16")
BATCHES = (1, 3)


def _int8_logits_bound() -> float:
    """Bound on ||logits_w8a8 - logits_fp32|| / ||logits_fp32|| for the tiny model under w8a8-int8.
    One int8 operand row of K values, s = absmax / 127, round to nearest: each element's error is
    at most s/2 and, as uniform rounding noise, s/sqrt(12) RMS, so the row's relative RMS error is
    (absmax / rms) / (127 sqrt(12)) <= sqrt(K) / (127 sqrt(12)) (absmax <= ||row|| = sqrt(K) rms:
    the crest factor's hard maximum). A Linear quantizes both operands: output relative error
    <= eps_x + eps_w = 2 eps(K) (independent random-sign errors through an independent random
    matrix keep their relative size). Each layer's 7 Linears add their errors to the logits
    with gain <= 1 (RMSNorm is scale-invariant, the fp32 LM head is linear, the attention
    softmax of a std-0.02 initialisation is near uniform) except gate_proj's, which passes
    SiLU: d log silu(x) / d log x = 1 + x (1 - sigmoid(x)) <= 1.28. K is H for q/k/v/o/gate/up
    (o reads heads x head_dim = H) and I for down_proj. The bound adds every term (worst-case
    signs): 2 layers -> 0.577, while 200 seeds measured 0.0068 .. 0.0113."""
    eps = lambda k: math.sqrt(k) / (127 * math.sqrt(12))  # noqa: E731
    per_layer = 5 * 2 * eps(H) + 1.28 * 2 * eps(H) + 2 * eps(I)
    return LAYERS * per_layer


def _run(tmp_path, seed: int, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    rc = main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--layers", str(LAYERS), "--dtype", "fp32",
               "--recipes", ",".join(RECIPES), "--no-compile", "--quick", "--prefill", "37", "--context", "21",
               "--batches", ",".join(map(str, BATCHES)), "--error-tokens", "29", "--seed", str(seed),
               "--budget", "3600",  # a busy CPU must not skip steps
               "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_rows_weights_and_logits_error(tmp_path, rng, capsys):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    rc, run = _run(tmp_path, seed, "--plot", str(tmp_path / "bench.png"))
    assert rc == 0
    assert run["environment"]["options"]["shape"] == "tiny" and run["environment"]["transformers"]
    rows = run["rows"]
    # one eager row per variant, phase and batch; no compiled rows with --no-compile
    want = {(v, "eager", p, b) for v in ("fp32", *RECIPES) for p, b in [("prefill", 1)] + [("decode", b) for b in BATCHES]}
    assert sorted((r["variant"], r["mode"], r["phase"], r["batch"]) for r in rows) == sorted(want)
    for r in rows:
        assert not r.get("error") and not r.get("skipped"), r
        assert r["ms"] > 0 and r["tokens"] == (37 if r["phase"] == "prefill" else r["batch"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["ms"] * 1e-3), rel=1e-12)
        assert r["baseline"] == "fp32" and r["speedup"] > 0 and r["weights_ratio"] > 0
        assert r["kind"] == ("baseline" if r["variant"] == "fp32" else "lowbit")
        assert "peak_bytes" not in r          # no CUDA allocator on the CPU
    by = {r["variant"]: r for r in rows if r["phase"] == "prefill"}
    # the baseline holds its float32 parameters and buffers, each once (tied or not)
    model = llama.build_llama("tiny", LAYERS, torch.float32, "cpu", seed)
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    assert by["fp32"]["weight_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # w8a8-int8: at least one byte per quantized weight (wherever the codes live: QTensors in
    # module attributes, or buffers of a merged q/k/v module) plus the float32 tensors left
    # (embeddings, norms, LM head), and less than the float32 model
    from lowbit.nn import QuantLinear
    from lowbit.pipelines.quantize_model import quantize_model
    quantize_model(model, "w8a8-int8")
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    floats = {t.data_ptr(): t for m in model.modules() if not isinstance(m, QuantLinear)
              for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)] if t.is_floating_point()}
    floor = (sum(q.in_features * q.out_features for q in qls)
             + sum(t.numel() * t.element_size() for t in floats.values()))
    assert floor <= by["w8a8-int8"]["weight_bytes"] < by["fp32"]["weight_bytes"]
    assert by["w8a8-int8"]["paths"]        # QuantLinear.last_path was recorded
    # logits' relative error: exactly 0 for the baseline, below the derived bound for int8,
    # finite and non-zero (the model was quantized) for both recipes
    assert by["fp32"]["logits_rel_err"] == 0.0
    assert 0 < by["w8a8-int8"]["logits_rel_err"] < _int8_logits_bound()
    for r in rows:
        if r["kind"] != "baseline":
            assert 0 < r["logits_rel_err"] < math.inf and 0 < r["out_rel_err"] < math.inf
    printed = capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:   # the GPU machine has no matplotlib: the run says so instead
        assert "# no plot" in printed and not (tmp_path / "bench.png").exists()
    table = printed[printed.index("# lowbit bench model"):]
    assert all(v in table for v in ("fp32", *RECIPES))


@pytest.mark.parametrize("static", [True, False])
def test_decode_step_matches_a_full_forward(rng, static):
    """One decode step after a filled cache gives the logits a full forward pass gives at that
    position, and repeating it (as the timer does) changes nothing. float64, so the only
    difference is the order of rounding: two evaluations of the same float64 function differ
    by at most ~(n u) per reduction of n <= I terms times the ~30 sequential stages of 2 layers,
    (176 * 30) * 2^-53 = 5.9e-13 relative, times the logits' condition number; 2^-30 leaves a
    condition number of 1800 (a std-0.02 random Llama is far better conditioned), while a
    wrong position or a stale slot changes the logits at the 1e-2 level."""
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    model = llama.build_llama("tiny", LAYERS, torch.float64, "cpu", seed)
    C, B = 19, 3
    ctx = torch.randint(0, 256, (B, C), generator=rng)
    tok = torch.randint(0, 256, (B, 1), generator=rng)
    with torch.no_grad():
        full = llama.full_logits(model, torch.cat([ctx, tok], 1))[:, -1]
        cache, kind = llama.new_cache(model, B, C + 5, static=static)
        assert kind == ("static" if static else "dynamic")
        llama.fill_cache(model, cache, ctx)
        fn, args = llama.decode_step(model, cache, kind, tok, C)
        outs = [fn(*args) for _ in range(3)]
        llama.check_repeatable(cache, C)
    for out in outs:
        assert out.shape == (B, 256)
        assert ((out - full).norm() / full.norm()).item() <= 2.0 ** -30
    # the oracle is sharp: the same step one position later (what a cache that kept appending
    # would compute) is far outside that tolerance
    with torch.no_grad():
        shifted = llama.full_logits(model, torch.cat([ctx, tok, tok], 1))[:, -1]
    assert ((shifted - full).norm() / full.norm()).item() > 2.0 ** -20


def test_resident_bytes_counts_attribute_tensors_once():
    m = torch.nn.Linear(8, 4)
    m.extra = {"a": torch.zeros(10, dtype=torch.int8), "b": [m.weight]}   # a cache and a second reference
    assert resident_bytes(m, torch.device("cpu")) == (32 + 4) * 4 + 10


def test_bad_input(tmp_path, capsys):
    assert main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--recipes", "w8a8-int9"]) == 2
    err = capsys.readouterr().err
    assert "recipes=w8a8-int9" in err and "w8a8-int8" in err
    assert main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--batches", "1,x"]) == 2
    assert "--batches" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "model"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err


def test_torchao_absent_is_a_skip_on_every_row(monkeypatch):
    """The GPU machine has no torchao: its variants are rows that say so, not a crash."""
    import sys

    from lowbit.bench.model import Options, _plan, measure_variant
    from lowbit.bench.model_measure import Inputs
    monkeypatch.setitem(sys.modules, "torchao", None)     # `import torchao...` now fails as if absent
    opts = Options(shape="tiny", layers=1, dtype="fp32", device="cpu", batches=(1, 2), log=lambda m: None)
    master = llama.build_llama("tiny", 1, torch.float32, "cpu", 0)
    rows = measure_variant("torchao-int8", "torchao", master, Inputs.make(opts, 256, torch.device("cpu")), opts,
                           {}, {})
    assert [(r["mode"], r["phase"], r["batch"]) for r in rows] == _plan(opts)
    assert len(rows) == 8 and all(r.get("skipped") == "torchao not installed" and r["ms"] is None for r in rows), \
        [(r.get("skipped"), r.get("error")) for r in rows]


def test_budget_and_a_broken_cuda_context_end_in_rows_not_a_crash(monkeypatch):
    """A variant past its time budget skips its remaining steps; a CUDA error (faked here) makes
    every later step and variant a skip that names it, while the baseline's rows stay measured."""
    from lowbit.bench import model as bm
    opts = dict(shape="tiny", layers=1, dtype="fp32", device="cpu", modes=("eager",), prefill=9, context=7,
                batches=(1, 2), error_tokens=5, quick=True, log=lambda m: None)
    rows = bm.run_bench(bm.Options(variants=("w4a16",), budget=0.0, **opts))
    assert all(r["ms"] > 0 for r in rows if r["kind"] == "baseline")
    assert [r.get("skipped") for r in rows if r["variant"] == "w4a16"] == ["variant time budget (0 s) spent"] * 3

    real = bm.run_step

    def fake(model, mode, phase, batch, inp, o, row, *rest):
        if row["variant"] == "w8a8-int8":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(model, mode, phase, batch, inp, o, row, *rest)
    monkeypatch.setattr(bm, "run_step", fake)
    rows = bm.run_bench(bm.Options(variants=("w8a8-int8", "w4a16"), budget=3600.0, **opts))
    by = {(r["variant"], r["phase"], r["batch"]): r for r in rows}
    assert all(by[("fp32", p, b)]["ms"] > 0 for p, b in (("prefill", 1), ("decode", 1), ("decode", 2)))
    assert by[("w8a8-int8", "decode", 1)]["error"].startswith("RuntimeError: CUDA error")   # the first step
    assert by[("w8a8-int8", "prefill", 1)]["skipped"] == "not run: the CUDA context broke"
    assert all(r["skipped"].startswith("CUDA context broken by an earlier error")
               for r in rows if r["variant"] == "w4a16")


def test_memory_plot_from_a_run(tmp_path):
    """`python -m lowbit.bench.memory --plot JSON PNG` draws a committed H200 run (benchmarks/results/bench-memory.json)
    without a GPU: a PNG whose height grows with the number of quantizer rows."""
    import json
    import os
    import struct

    from lowbit.bench.memory_report import plot
    src = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "bench-memory.json")
    rows = json.load(open(src))["rows"]
    sizes = []
    for keep in (rows, [r for r in rows if "8192x8192" not in r["shape"]]):
        out = tmp_path / f"m{len(keep)}.png"
        plot(keep, str(out))
        head = out.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        sizes.append(struct.unpack(">II", head[16:24]))            # IHDR width, height
    assert sizes[0][0] == sizes[1][0] and sizes[0][1] > sizes[1][1], sizes


def test_time_limit_shares_the_time_left(monkeypatch):
    """Without --budget, each variant gets an equal share of what the time limit leaves when it
    starts: about half of it for the first of two, all that is left for the last (the baseline
    is never cut short)."""
    from lowbit.bench import model as bm
    seen = []
    real = bm.measure_variant

    def spy(name, kind, master, inp, opts, ref, state, budget=None):
        seen.append((name, budget))
        return real(name, kind, master, inp, opts, ref, state, budget=budget)
    monkeypatch.setattr(bm, "measure_variant", spy)
    opts = bm.Options(shape="tiny", layers=1, dtype="fp32", device="cpu", modes=("eager",), prefill=9, context=7,
                      batches=(1,), error_tokens=5, quick=True, budget=None, time_limit=1e6,
                      variants=("w4a16", "w8a8-int8"), log=lambda m: None)
    bm.run_bench(opts)
    assert seen[0] == ("fp32", 30.0)           # the baseline: measured whatever the budget says
    assert [n for n, _ in seen[1:]] == ["w4a16", "w8a8-int8"]
    assert 1e6 / 2 * 0.99 < seen[1][1] <= 1e6 / 2 and 1e6 * 0.99 < seen[2][1] <= 1e6   # 2 left, then 1 left
