"""Next-token KL divergence and top-1 agreement (lowbit.evaluation.evaluate.token_metrics) against a
float64 numpy reference on toy causal models; identical models give KL exactly 0."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lowbit.evaluation.evaluate import (cached_reference_logits, perplexity, prepare_reference, reference_logits,
                                token_metrics)


class ToyLM(torch.nn.Module):
    """ids [1, n] -> logits [1, n, vocab]: an embedding, a running mean over the prefix (so a
    token's logits depend on its context, as a causal LM's do) and a linear read-out."""

    def __init__(self, vocab: int, dim: int, gen: torch.Generator, spread: float):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim, generator=gen))
        self.out = torch.nn.Parameter(spread * torch.randn(dim, vocab, generator=gen))

    def forward(self, ids):
        h = self.emb[ids]
        h = h.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[None, :, None]
        return SimpleNamespace(logits=torch.tanh(h) @ self.out)


def _pair(rng):
    vocab = int(torch.randint(17, 90, (1,), generator=rng))
    dim = int(torch.randint(3, 20, (1,), generator=rng))
    spread = float(torch.empty(1).uniform_(0.5, 6.0, generator=rng))
    a = ToyLM(vocab, dim, rng, spread)
    b = ToyLM(vocab, dim, rng, spread)
    with torch.no_grad():   # b: a with noise, so agreement is neither 0 nor 1
        noise = float(torch.empty(1).uniform_(0.01, 0.5, generator=rng))
        b.emb.copy_(a.emb + noise * b.emb)
        b.out.copy_(a.out + noise * spread * torch.randn(a.out.shape, generator=rng))
    window = int(torch.randint(5, 40, (1,), generator=rng))
    n = window * int(torch.randint(1, 5, (1,), generator=rng)) + int(torch.randint(0, window, (1,), generator=rng))
    ids = torch.randint(0, vocab, (n,), generator=rng)
    return a, b, ids, window


def test_identical_models_give_zero_kl_and_full_agreement(rng):
    a, _, ids, window = _pair(rng)
    tm = token_metrics(a, ids, reference_logits(a, ids, window), window)
    assert tm.kl == 0.0 and tm.kl_max == 0.0 and tm.top1 == 1.0
    assert tm.perplexity == perplexity(a, ids, window)      # the same NLL arithmetic, bit for bit
    assert tm.tokens == (len(ids) // window) * (window - 1)  # a short tail is dropped, as perplexity() does


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_kl_and_top1_match_a_float64_reference(rng):
    a, b, ids, window = _pair(rng)
    tm = token_metrics(b, ids, reference_logits(a, ids, window), window)
    kls, agree, lmax = [], [], 0.0
    for i in range(len(ids) // window):
        w = ids[i * window:(i + 1) * window][None]
        la = a(w).logits[0, :-1].detach().numpy()      # float32, as the models produce them
        lb = b(w).logits[0, :-1].detach().numpy()
        lp, lq = _log_softmax64(la), _log_softmax64(lb)
        kls.append((np.exp(lp) * (lp - lq)).sum(-1))
        agree.append(la.argmax(-1) == lb.argmax(-1))
        lmax = max(lmax, np.abs(lp).max(), np.abs(lq).max())
    kls, agree = np.concatenate(kls), np.concatenate(agree)
    # Both sides take float64 log-softmaxes of the same float32 logits. Each log-prob is within a
    # few ulps of its magnitude (max - x, one log, one subtraction: <= 4 ulps; 2x margin: 8), so
    # sum_v p_v (lp_v - lq_v) moves by <= 2 * 8 eps max|lp, lq| (the p_v sum to 1); exp(lp) to 1 ulp
    # and the V-term float64 sum add <= (V + 1) eps max|lp - lq| <= (V + 1) eps 2 max|lp, lq|.
    # The mean and the max over tokens inherit the per-token bound.
    eps = 2.0 ** -52
    tol = eps * lmax * (16 + 2 * (a.out.shape[1] + 1))
    assert abs(tm.kl - kls.mean()) <= tol, (tm.kl, kls.mean(), tol)
    assert abs(tm.kl_max - kls.max()) <= tol
    assert tm.kl > 0
    assert tm.top1 == agree.mean()   # argmax of the same float32 logits: exact
    assert tm.perplexity == perplexity(b, ids, window)
    assert token_metrics(b, ids, a, window) == tm    # the float model as reference: same numbers, bit for bit


def test_prepared_and_cached_references_give_the_same_metrics(rng, tmp_path):
    """The measure driver's fast reference (log-probabilities prepared once, logits kept on disk)
    changes no number: bit-identical metrics; a changed model or text is a cache miss."""
    a, b, ids, window = _pair(rng)
    ref = reference_logits(a, ids, window)
    tm = token_metrics(b, ids, ref, window)
    assert token_metrics(b, ids, prepare_reference(ref), window) == tm
    first = cached_reference_logits(a, ids, window, tmp_path)        # computed and written
    again = cached_reference_logits(a, ids, window, tmp_path)        # read back
    assert len(list(tmp_path.iterdir())) == 1
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(ref, first, again))
    with torch.no_grad():
        a.out[0, 0] += 1.0
    changed = cached_reference_logits(a, ids, window, tmp_path)      # new key: recomputed, not the stale file
    assert len(list(tmp_path.iterdir())) == 2
    assert all(torch.equal(x, y) for x, y in zip(changed, reference_logits(a, ids, window)))
    other = ids.clone()
    other[-1] = (other[-1] + 1) % a.emb.shape[0]
    cached_reference_logits(a, other, window, tmp_path)
    assert len(list(tmp_path.iterdir())) == 3


def test_reference_must_match_the_windows(rng):
    a, _, ids, window = _pair(rng)
    ref = reference_logits(a, ids, window)
    with pytest.raises(ValueError, match="reference_logits"):
        token_metrics(a, ids, ref[:-1] if len(ref) > 1 else ref + ref, window)
    with pytest.raises(ValueError, match="reference_logits"):
        token_metrics(a, ids, ref, window - 1)
    with pytest.raises(ValueError, match="reference_logits"):
        token_metrics(a, ids, prepare_reference(ref), window - 1)


def test_measure_configs_are_distinct():
    """Every row of the measure driver is one configuration (the JSON resume keys on it)."""
    from lowbit.experiments.perplexity_table import CONFIGS
    keys = [c.key() for c in CONFIGS]
    assert len(keys) == len(set(keys))


def test_measure_resume_measures_only_missing_rows(tmp_path, monkeypatch):
    """The driver's bookkeeping (the measurement itself stubbed): --resume keeps the JSON's rows and
    measures only the other selected configurations; the table has one line per row."""
    import json
    from dataclasses import asdict

    from lowbit.experiments import perplexity_table as measure
    calls = []

    def fake(tokens, calib_tokens, threads, cache, cfg):
        calls.append(cfg.key())
        return {"key": cfg.key(), "config": asdict(cfg), "measures": cfg.measures(), "perplexity": 10.0 + len(calls),
                "kl": 0.01 * len(calls), "kl_max": 0.1, "top1": 0.9, "tokens": 7, "bytes": 2**20, "overrides": [],
                "calib_s": 1.0, "total_s": 2.0}
    monkeypatch.setattr(measure, "_worker", fake)
    out = tmp_path / "t.md"
    assert measure.main(["--out", str(out), "--tokens", "64", "--only", "nvfp4", "--methods", "rtn"]) == 0
    first = list(calls)
    assert first == [c.key() for c in measure.CONFIGS if c.recipe == "float" or
                     (c.recipe == "nvfp4" and c.method == "rtn")]
    calls.clear()
    assert measure.main(["--out", str(out), "--tokens", "64", "--only", "nvfp4,mxfp4", "--resume"]) == 0
    assert calls == [c.key() for c in measure.CONFIGS if c.key() not in first and c.recipe in ("nvfp4", "mxfp4")]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert sorted(r["key"] for r in rows) == sorted(first + calls)
    table = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| recipe")]
    assert len(table) == len(rows)


def test_measure_key_selects_configurations(tmp_path, monkeypatch):
    """--key measures exactly the named configurations (plus the float row, the KL baseline); an
    unknown key stops the driver before anything is measured, naming the flag."""
    from dataclasses import asdict

    from lowbit.experiments import perplexity_table as measure
    calls = []

    def fake(tokens, calib_tokens, threads, cache, cfg):
        calls.append(cfg.key())
        return {"key": cfg.key(), "config": asdict(cfg), "measures": cfg.measures(), "perplexity": 10.0 + len(calls),
                "kl": 0.01, "kl_max": 0.1, "top1": 0.9, "tokens": 7, "bytes": 2**20, "overrides": [],
                "calib_s": 1.0, "total_s": 2.0}
    monkeypatch.setattr(measure, "_worker", fake)
    picked = [measure.CONFIGS[-1].key(), measure.CONFIGS[3].key()]
    out = tmp_path / "k.md"
    assert measure.main(["--out", str(out), "--tokens", "64", "--key", picked[0], "--key", picked[1]]) == 0
    assert calls == [c.key() for c in measure.CONFIGS if c.recipe == "float" or c.key() in picked]
    calls.clear()
    with pytest.raises(SystemExit, match="--key"):
        measure.main(["--out", str(tmp_path / "u.md"), "--tokens", "64", "--key", "w8a8-fp8 | no such measure"])
    assert calls == []


def test_measure_goes_on_after_any_configuration_error(tmp_path, monkeypatch, capsys):
    """A configuration that raises anything (here a TypeError, which the driver once let escape: in a
    process pool that made the pool's exit wait for every other configuration and drop their rows) is
    reported with its traceback; the rows after it are measured and written, and the exit code is 1."""
    import json
    from dataclasses import asdict

    from lowbit.experiments import perplexity_table as measure
    keys = [c.key() for c in measure.CONFIGS if c.recipe == "nvfp4" and c.method == "rtn"]
    bad = keys[1]

    def fake(tokens, calib_tokens, threads, cache, cfg):
        if cfg.key() == bad:
            raise TypeError("unsupported operand in a stubbed measure")
        return {"key": cfg.key(), "config": asdict(cfg), "measures": cfg.measures(), "perplexity": 11.0,
                "kl": 0.01, "kl_max": 0.1, "top1": 0.9, "tokens": 7, "bytes": 2**20, "overrides": [],
                "calib_s": 1.0, "total_s": 2.0}
    monkeypatch.setattr(measure, "_worker", fake)
    out = tmp_path / "e.md"
    assert measure.main(["--out", str(out), "--tokens", "64", "--only", "nvfp4", "--methods", "rtn"]) == 1
    printed = capsys.readouterr().out
    assert f"{bad}" in printed and "FAILED: TypeError: unsupported operand" in printed and "Traceback" in printed
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert sorted(r["key"] for r in rows) == sorted(["float | none"] + [k for k in keys if k != bad])


def test_float_reference_is_one_pass_of_both(rng, monkeypatch):
    """float_reference: perplexity() and reference_logits() from one pass, bit for bit, and the
    metrics of a quantized stand-in against its logits are those against the model run again;
    logits beyond REFERENCE_BYTES are not kept (the model itself is the reference)."""
    from lowbit.evaluation import evaluate
    a, b, ids, window = _pair(rng)
    a.config = SimpleNamespace(vocab_size=a.out.shape[1])
    ppl, logits = evaluate.float_reference(a, ids, window)
    assert ppl == perplexity(a, ids, window)
    want = reference_logits(a, ids, window)
    assert len(logits) == len(want) and all(torch.equal(x, y) for x, y in zip(logits, want))
    assert token_metrics(b, ids, logits, window) == token_metrics(b, ids, a, window)
    rows = (len(ids) // window) * (window - 1)
    monkeypatch.setattr(evaluate, "REFERENCE_BYTES", 4 * a.out.shape[1] * rows - 1)
    ppl2, ref = evaluate.float_reference(a, ids, window)
    assert ref is a and ppl2 == ppl
