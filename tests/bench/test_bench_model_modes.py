"""`lowbit bench model` end to end on the CPU in every mode (eager, compile, graphs: torch.compile's
aot_eager backend stands in for inductor), with a quantized-LM-head variant and a torchao row:
the rows a GPU run will give, the decode step's bytes (checked against the model's own tensors
and config), the roof column, the weight bytes a quantized head saves, and the targets' verdicts.
CPU times mean nothing and are not asserted."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from lowbit.bench import llama, model_report  # noqa: E402
from lowbit.bench.model_measure import resident_bytes  # noqa: E402
from lowbit.bench.model_targets import add_musts, decode_bytes, kv_bytes  # noqa: E402
from lowbit.entrypoints.main import main  # noqa: E402

CTX, BATCHES, PREFILL = 11, (1, 2), 17
VARIANTS = ("w4a16", "w4a16+lm_head=int8", "torchao-int8wo")


def test_every_mode_end_to_end(tmp_path, rng, capsys):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    out = tmp_path / "bench.json"
    rc = main(["bench", "model", "--device", "cpu", "--shape", "tiny", "--layers", "1", "--dtype", "fp32",
               "--recipes", ",".join(VARIANTS), "--modes", "eager,compile,graphs", "--compile-backend", "aot_eager",
               "--quick", "--prefill", str(PREFILL), "--context", str(CTX), "--batches", ",".join(map(str, BATCHES)),
               "--error-tokens", "9", "--seed", str(seed), "--budget", "3600", "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())
    rows, env = run["rows"], run["environment"]
    assert env["copy_bw"] > 0
    plan = {("eager", "prefill", 1), ("compile", "prefill", 1)} | {
        (m, "decode", b) for m in ("eager", "compile", "graphs") for b in BATCHES}
    for v in ("fp32",) + VARIANTS:
        got = {(r["mode"], r["phase"], r["batch"]) for r in rows if r["variant"] == v}
        assert got == plan, v
    for r in rows:
        if r["kind"] == "torchao" and (r.get("error") or r.get("skipped")):
            continue        # torchao's CPU support varies by version: a row that says why is enough
        assert r["ms"] > 0 and not r.get("error") and not r.get("skipped"), r
        if r["mode"] != "eager":
            assert r["graph_breaks"] == 0, r
            assert r["vs_eager_rel"] < 1e-5, r    # the same ops traced (fp32; only fusion-free reordering)
        if r["phase"] == "decode":
            assert r["roof"] == pytest.approx(r["bytes_per_step"] / (r["ms"] * 1e-3) / env["copy_bw"], rel=1e-12)
        else:
            assert "bytes_per_step" not in r and "roof" not in r
    # the decode step's bytes, from the model's own numbers: every fp32 parameter and buffer (the
    # rotary frequencies), minus the embedding rows not looked up, plus K and V of CTX tokens per sequence
    model = llama.build_llama("tiny", 1, torch.float32, "cpu", seed)
    c = model.config
    params = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    hd = c.hidden_size // c.num_attention_heads
    for b in BATCHES:
        r = next(r for r in rows if r["variant"] == "fp32" and r["mode"] == "eager" and r["batch"] == b
                 and r["phase"] == "decode")
        want = params - (c.vocab_size - b) * c.hidden_size * 4 + 2 * b * CTX * c.num_key_value_heads * hd * 4
        assert r["bytes_per_step"] == want
    # the quantized LM head: weight bytes drop by the float head's bytes minus what the quantized head holds
    from lowbit.pipelines.quantize_model import quantize_model
    quantize_model(model, "w4a16", lm_head="int8")
    head_q = resident_bytes(model.lm_head, torch.device("cpu"))
    assert 0 < head_q < c.vocab_size * c.hidden_size * 4
    # (a torchao row that says why it did not run carries no weights: skipped above too)
    w = {r["variant"]: r["weight_bytes"] for r in rows if "weight_bytes" in r}
    assert w["w4a16"] - w["w4a16+lm_head=int8"] == c.vocab_size * c.hidden_size * 4 - head_q
    printed = capsys.readouterr().out
    tail = printed[printed.index("# lowbit bench model"):]
    assert all(v in tail for v in VARIANTS) and " roof" in tail
    assert tail.rstrip().splitlines()[-1].startswith("# targets: none for --shape tiny")


def test_decode_bytes_with_a_tied_head(rng):
    """A tied LM head reads the whole embedding table every step: nothing is subtracted."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    held = resident_bytes(m, torch.device("cpu"))
    assert decode_bytes(held, m, 3, 5) == held + kv_bytes(cfg, 3, 5, 2)
    assert kv_bytes(cfg, 3, 5, 2) == 2 * 2 * 3 * 5 * 2 * 16 * 2


def _row(variant, kind, mode, phase, batch, speedup=None, weights_ratio=None):
    r = dict(name=f"{variant} {mode} {phase} b{batch}", variant=variant, kind=kind, mode=mode, phase=phase,
             batch=batch, ms=None if speedup is None else 1.0)
    if speedup is not None:
        r["speedup"] = speedup
    if weights_ratio is not None:
        r["weights_ratio"] = weights_ratio
    return r


def test_targets_verdicts():
    rows = [_row("w4a16", "lowbit", "graphs", "decode", 1, 2.6, 0.36),
            _row("w4a16+lm_head=int8", "lowbit", "graphs", "decode", 1, 2.4, 0.30),
            _row("w8a8-fp8", "lowbit", "eager", "decode", 1, 0.9, 0.60),
            _row("w8a8-int8", "lowbit", "compile", "prefill", 1, 1.6),
            _row("w8a8-int8", "lowbit", "graphs", "decode", 16),            # did not run
            _row("mxfp4", "lowbit", "graphs", "decode", 16, 9.0),           # no target there
            _row("torchao-int4", "torchao", "graphs", "decode", 1, 3.0, 0.3),
            _row("bf16", "baseline", "graphs", "decode", 1, 1.0, 1.0)]
    add_musts(rows, "4b", 32)
    assert not any("must" in r for r in rows)          # another shape: no verdicts
    add_musts(rows, "8b", 32)
    got = [(r.get("must"), r.get("met")) for r in rows]
    assert got == [(2.5, True), (2.5, False), (1.0, False), (1.5, True), (1.5, None), (None, None), (None, None),
                   (None, None)]
    assert [(r.get("weights_must"), r.get("weights_met")) for r in rows[:3]] == [(0.37, True), (0.37, True),
                                                                                (0.57, False)]
    text = model_report.targets(rows, "8b", 32)
    # speed: 2 met, 2 missed, 1 not run; weights: w4a16 and its lm_head variant met, w8a8-fp8 missed,
    # w8a8-int8 and mxfp4 not measured
    assert text.splitlines()[0] == "# targets (ratios vs the baseline, same mode): 4 met, 3 missed, 3 not run"
    assert "w8a8-fp8 eager decode b1" in text and "MISSED" in text and "torchao" not in text
