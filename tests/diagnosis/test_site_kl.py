"""lowbit.diagnosis.site_kl: overrides picked by the measured next-token KL, against brute force (every
site overridden alone in a freshly quantized copy, the whole model re-run)."""
import copy

import pytest
import torch

from llama_fixtures import outlier_llama
from lowbit.recipes.plan import linear_layers
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.diagnosis.site_kl import kl_pick
from lowbit.verify.metrics import kl_sum


def _kl(model, q, batches):
    """Sum over the batches' tokens of the next-token KL(model || q), in the batches' order as kl_pick sums."""
    return sum(kl_sum(torch.log_softmax(model(b, use_cache=False).logits[0, :-1].double(), -1),
                      q(b, use_cache=False).logits[0, :-1]) for b in batches)


def _quantized(model, recipe, overrides, ignore):
    q = copy.deepcopy(model)
    quantize_model(q, recipe, ignore=ignore, overrides=overrides or None, share_inputs=False)
    return q


@torch.no_grad()
def test_kl_pick_matches_brute_force(rng):
    """Weight-only recipes keep the test cheap (the activation quantizer is what costs time on the CPU;
    the picking does not depend on the recipe); q/k_proj ignored, so candidates are the other 10 sites."""
    model = outlier_llama(rng, 80)
    batches = [torch.randint(0, 97, (1, int(torch.randint(9, 24, (1,), generator=rng))), generator=rng)
               for _ in range(2)]
    recipe, ignore = "w4a16", ["*.q_proj", "*.k_proj"]
    names = [n for n in linear_layers(model) if n != "lm_head" and not n.endswith(("q_proj", "k_proj"))]
    tokens = sum(b.shape[1] - 1 for b in batches)
    # n=1, every site measured on every batch: the pick is brute force's argmax, with its drop. The
    # replayed blocks compute what the whole model computes (same modules, same inputs, same order),
    # so the values are equal exactly, not within a tolerance. (KLPick's values are per token: the
    # sums divided by the token count, as here.)
    p = kl_pick(model, batches, recipe, 1, ignore=ignore, effect="restore", screen=len(batches),
                shortlist=len(names))
    full = _kl(model, _quantized(model, recipe, {}, ignore), batches)
    assert p.kl_quantized == full / tokens
    drops = {n: (full - _kl(model, _quantized(model, recipe, {n: "skip"}, ignore), batches)) / tokens for n in names}
    assert p.screened == drops
    best = max(drops, key=drops.get)
    assert p.picked == [best] and p.gains[best] == drops[best]
    # n=3 by the default screen (first batch) and shortlist (9): the first pick is the shortlist's best
    # on all batches; the picked sites' KL is what quantizing with them overridden gives
    p3 = kl_pick(model, batches, recipe, 3, ignore=ignore, effect="restore")
    short = sorted(names, key=lambda n: -p3.screened[n])[:9]
    first = max(short, key=drops.get)
    assert p3.picked[0] == first and p3.gains[first] == drops[first]
    assert len(set(p3.picked)) == 3 and set(p3.picked) <= set(short)
    assert p3.kl_picked == _kl(model, _quantized(model, recipe, {n: "skip" for n in p3.picked}, ignore), batches) / tokens
    # overridden to another recipe instead of high precision
    p2 = kl_pick(model, batches, recipe, 2, to="w8a16-int8", ignore=ignore, effect="restore")
    over = _quantized(model, recipe, {n: "w8a16-int8" for n in p2.picked}, ignore)
    assert p2.kl_picked == _kl(model, over, batches) / tokens
    # effect "alone": each site quantized alone in the float model (every other Linear ignored)
    pa = kl_pick(model, batches, recipe, 2, ignore=ignore, screen=len(batches), shortlist=len(names))
    alone = {n: _kl(model, _quantized(model, recipe, {}, ignore + [o for o in names if o != n]), batches) / tokens
             for n in names}
    assert pa.screened == alone
    assert pa.picked == sorted(names, key=lambda n: -alone[n])[:2]


def test_kl_pick_refuses_bad_arguments(rng):
    model = outlier_llama(rng, 48)
    batches = [torch.randint(0, 97, (1, 12), generator=rng) for _ in range(2)]
    with pytest.raises(ValueError, match="screen"):
        kl_pick(model, batches, "w8a8-fp8", 1, screen=3)
    with pytest.raises(ValueError, match="shortlist"):
        kl_pick(model, batches, "w8a8-fp8", 4, shortlist=2)
    with pytest.raises(ValueError, match="only 14 Linears"):
        kl_pick(model, batches, "w8a8-fp8", 15, shortlist=15)
    with pytest.raises(ValueError, match="effect"):
        kl_pick(model, batches, "w8a8-fp8", 1, effect="both")
    with pytest.raises(ValueError, match=r"input ids \[1, T\]"):
        kl_pick(model, [{"input_ids": batches[0]}], "w8a8-fp8", 1)
    assert kl_pick(model, batches, "w8a8-fp8", 0).picked == []


def test_job_override_by_is_checked(rng):
    from lowbit.evaluation.workload import Loaded, Texts
    from lowbit.workflows.job import Measures, QuantizeJob
    from lowbit.workflows.quantize import quantize_job
    from lowbit.workflows.steps import OverrideWorst
    model = outlier_llama(rng, 48)
    texts = Texts(None, [torch.randint(0, 97, (1, 12), generator=rng)], [])
    with pytest.raises(ValueError, match="override_by='nope'"):
        Measures(override_worst=0.1, override_by="nope").steps()
    with pytest.raises(ValueError, match="override_by='nope'"):
        OverrideWorst(0.1, by="nope")
    job = QuantizeJob.build("w8a8-fp8", [OverrideWorst(0.1, by="kl")])
    with pytest.raises(ValueError, match="causal language model"):
        quantize_job(Loaded("toy", model, None, "encoder"), texts, job)
