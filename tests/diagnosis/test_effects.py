"""Per-site reports before/after each calibration algorithm (lowbit.diagnosis.effects): the report of
given QuantLinears is the report of their stored codes, and the model is left unchanged."""
import copy
import statistics

import torch
from llama_fixtures import outlier_llama

from lowbit.diagnosis.effects import algorithm_effect, summary_rows
from lowbit.nn.quant_linear import QuantLinear
from lowbit.recipes.plan import linear_layers
from lowbit.recipes.presets import get_recipe
from lowbit.diagnosis.sites import site_report, sqnr_db


def _batches(rng, n, t=24):
    return [torch.randint(0, 97, (1, t), generator=rng) for _ in range(n)]


def test_given_round_to_nearest_layers_reproduce_the_plain_report(rng):
    """site_report(quantized=RTN's own QuantLinears) is bit for bit the plain report."""
    model = outlier_llama(rng, 72)
    r = get_recipe("w8a8-int8")
    batches = _batches(rng, 2)
    layers = {n: QuantLinear.from_linear(lin, r.weight, r.act, pad=True) for n, lin in linear_layers(model).items()
              if n != "lm_head"}
    a = site_report(model, batches, r)
    b = site_report(model, batches, r, quantized=layers)
    assert [vars(x) for x in a.rows] == [vars(x) for x in b.rows]


def test_gptq_effect_reports_the_stored_codes(rng):
    """The "after" weight SQNR of every site is that of the weight GPTQ stored (recomputed here from
    a second GPTQ run on the same inputs: GPTQ is deterministic), the model is not changed, and the
    summary counts over the sites both reports hold."""
    from lowbit.algorithms.gptq.model import gptq_model
    model = outlier_llama(rng, 72)
    ref = copy.deepcopy(model)
    calib, report = _batches(rng, 3), _batches(rng, 2)
    before, after = algorithm_effect(model, calib, report, "w4a16-g32", "gptq")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    g = copy.deepcopy(model)
    gptq_model(g, get_recipe("w4a16-g32"), calib)
    lin = linear_layers(model)
    for row in after.rows:
        w = lin[row.name].weight.detach().float()
        deq = g.get_submodule(row.name).weight_dequantized()
        assert row.weight_db == sqnr_db(float(w.pow(2).sum()), float((w - deq).pow(2).sum()))
    assert [r.name for r in before.rows] and {r.name for r in before.rows} == {r.name for r in after.rows}
    rows = summary_rows(before, after)
    assert [k for k, *_ in rows] == ["weight", "output", "block"]
    _, mb, ma, wb, wa, improved = rows[0]
    assert (mb, ma) == (statistics.median(r.weight_db for r in before.rows),
                        statistics.median(r.weight_db for r in after.rows))
    assert (wb, wa) == (min(r.weight_db for r in before.rows), min(r.weight_db for r in after.rows))
    old = {r.name: r.weight_db for r in before.rows}
    assert improved == sum(r.weight_db > old[r.name] for r in after.rows)
