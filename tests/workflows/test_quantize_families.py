"""The quantize job's SmoothQuant (a recipe's best measure by default) reads the decoder map: a family
with Linears that cannot be smoothed says so, a family the map does not know is refused before
anything is folded, and no family gets a silently broken float model."""
import pytest
import torch
from family_fixtures import tiny_decoder

from lowbit.evaluation.workload import Loaded, Texts
from lowbit.workflows.job import QuantizeJob
from lowbit.workflows.quantize import quantize_job
from lowbit.workflows.steps import SmoothQuant

SMOOTH = QuantizeJob.build("w8a8-int8", [SmoothQuant(0.5)])


def _texts(rng):
    ids = torch.randint(0, 97, (96,), generator=rng)
    return Texts(ids[:64], [ids[None, :32]], [ids[None, -32:]])


def test_partial_family_names_what_is_left(rng, capsys):
    loaded = Loaded("olmo2", tiny_decoder("olmo2", rng).float(), None, "causal")
    run = quantize_job(loaded, _texts(rng), SMOOTH, sites=False, progress=False, window=32)
    out = capsys.readouterr().out
    assert "w8a8-int8: SmoothQuant: OLMo 2: self_attn.q_proj, self_attn.k_proj" in out
    assert "of each of the 2 decoder layers" in out and "left unsmoothed" in out and run.value > 0


def test_unmapped_family_is_refused(rng):
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"SmoothQuant \(alpha 0.5.*refused: .*gpt2.*--plain"):
        quantize_job(Loaded("gpt2", m, None, "causal"), _texts(rng), SMOOTH, sites=False, progress=False, window=32)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
