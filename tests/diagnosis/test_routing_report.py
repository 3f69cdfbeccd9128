"""routing_report: flips, expert load and per-expert SQNR per MoE layer, checked against the
routers' own outputs (captured by the test's hooks), a derived SQNR bound and planted errors."""
import copy
import math

import pytest
import torch

from lowbit.diagnosis.routing_report import plot_routing, routing_report
from lowbit.nn.experts import QuantExperts
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.quantize import quantize
from moe_fixtures import ids, tiny_moe


def _top_k(model, batches):
    """{router name: top-k indices [tokens, k]} from forward hooks on the routers themselves."""
    got, hooks = {}, []
    for n, m in model.named_modules():
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
            got[n] = []
            hooks.append(m.register_forward_hook(lambda mod, a, out, n=n: got[n].append(out[-1])))
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_flips_load_and_positions_are_the_routers(family, rng):
    model = tiny_moe(family, rng, dtype=torch.float32)
    q = copy.deepcopy(model)
    quantize_model(q, "w8a8-int8")
    batches = [ids(rng, 21), ids(rng, 13)]
    routers = {n: m.weight.detach().clone() for n, m in q.named_modules() if n.endswith(".gate")}
    rep = routing_report(model, q, batches)
    assert all(torch.equal(q.get_submodule(n).weight, w) for n, w in routers.items())   # restored
    fa, fb = _top_k(model, batches), _top_k(q, batches)
    rq = copy.deepcopy(q)                 # the router-quantized comparison, built by hand
    with torch.no_grad():
        for n in routers:
            w = rq.get_submodule(n).weight
            w.copy_(quantize(w.float(), q.get_submodule(n[:-4] + "experts").weight_scheme).dequantize())
            rq.get_submodule(n).register_forward_pre_hook(lambda m, a: (quantize(
                a[0].reshape(-1, a[0].shape[-1]).float(), q.get_submodule(
                    next(iter(routers))[:-4] + "experts").act_scheme).dequantize().reshape(a[0].shape),))
    fc = _top_k(rq, batches)
    assert [L.router for L in rep.layers] == list(routers)
    for L in rep.layers:
        a, b, c = (t[L.router].sort(dim=1).values for t in (fa, fb, fc))
        changed = torch.nonzero((a != b).any(dim=1)).reshape(-1).tolist()
        assert L.tokens == 34 and len(L.flips) == len(changed)
        assert L.flips_router_quantized == int((a != c).any(dim=1).sum())
        want = [(0, 0, t) if t < 21 else (1, 0, t - 21) for t in changed]
        assert [(f.batch, f.row, f.position) for f in L.flips] == want
        assert [f.float_set for f in L.flips] == [tuple(a[t].tolist()) for t in changed]
        assert [f.quant_set for f in L.flips] == [tuple(b[t].tolist()) for t in changed]
        E = len(L.load_float)
        assert L.load_float == torch.bincount(fa[L.router].reshape(-1), minlength=E).tolist()
        assert L.load_quant == torch.bincount(fb[L.router].reshape(-1), minlength=E).tolist()
        assert sum(L.load_float) == 34 * fa[L.router].shape[1]
    assert "top-k set changed" in rep.to_markdown()


def test_weight_sqnr_bound_and_a_planted_expert(rng):
    """int8 per-channel weights: each element errs by at most half a step, amax_n / 254 of its
    row n, so SQNR >= 10 log10(sum w^2 / sum_n K (amax_n / 254)^2) for every expert (the
    quantizer's rounding of the scale to float32 moves that by ~1e-7 relative, far inside the
    half-step slack of real rounding errors). An expert whose down codes are zeroed outputs 0:
    its output and down-weight SQNR are then exactly 0 dB; the other experts are unchanged."""
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    q = copy.deepcopy(model)
    quantize_model(q, "w8a8-int8")
    batches = [ids(rng, 30)]
    before = routing_report(model, q, batches)
    L0 = before.layers[0]
    hot = max(range(len(L0.load_float)), key=lambda e: L0.load_float[e])
    qe = q.model.layers[0].mlp.experts
    assert isinstance(qe, QuantExperts)
    fe = model.model.layers[0].mlp.experts
    for p, w in (("gate_up", fe.gate_up_proj), ("down", fe.down_proj)):
        for e in range(w.shape[0]):
            we = w[e].detach().double()
            bound = 10 * math.log10(float(we.square().sum()) /
                                    float((we.abs().amax(dim=1) / 254).square().sum() * we.shape[1]))
            assert L0.weight_db[p][e] >= bound - 1e-5, (p, e, L0.weight_db[p][e], bound)
    with torch.no_grad():
        qe.down_codes[hot].zero_()
    after = routing_report(model, q, batches).layers[0]
    assert after.output_db[hot] == 0.0 and after.weight_db["down"][hot] == 0.0
    others = [e for e in range(len(L0.load_float)) if e != hot]
    same = lambda a, b: a == b or (math.isnan(a) and math.isnan(b))  # noqa: E731  nan: an expert with no token
    assert all(same(after.output_db[e], L0.output_db[e]) for e in others)
    assert L0.output_db[hot] > 0.0


def test_a_reversed_router_flips_every_token_of_its_layer(rng, tmp_path):
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    q = copy.deepcopy(model)
    quantize_model(q, "w4a16-g32")
    with torch.no_grad():
        q.model.layers[1].mlp.gate.weight.neg_()          # top-2 of 8 becomes bottom-2: every set changes
    batches = [ids(rng, 9), ids(rng, 5)]
    rep = routing_report(model, q, batches)
    L1 = rep.layers[1]
    assert len(L1.flips) == L1.tokens == 14 and L1.flip_fraction == 1.0
    assert [(f.batch, f.position) for f in L1.flips] == [(0, t) for t in range(9)] + [(1, t) for t in range(5)]
    assert "batch 1 row 0 position 4" in rep.to_markdown(max_flips=20)
    pytest.importorskip("matplotlib")
    png = plot_routing(rep, str(tmp_path / "r.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_refusals(rng):
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no MoE experts"):
        routing_report(dense, dense, [torch.zeros(1, 4)])
    model = tiny_moe("qwen3_moe", rng, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts is Qwen3MoeExperts.*quantize_model"):
        routing_report(model, copy.deepcopy(model), [ids(rng, 4)])


def test_mixed_recipes_name_each_routers_scheme(rng):
    """With an override giving one experts module another recipe, the comparison's router
    quantization is said per router (each as its own experts module's scheme), not as the first's."""
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    names = [n for n, m in model.named_modules() if n.endswith(".experts")]
    assert len(names) >= 2
    q = copy.deepcopy(model)
    quantize_model(q, "w8a8-int8", overrides={names[-1]: "w4a16-g32"})
    rep = routing_report(model, q, [ids(rng, 17)])
    said = rep.router_scheme
    for n in (names[0], names[-1]):
        qe = q.get_submodule(n)
        router = n[:-len("experts")] + "gate"
        act = qe.act_scheme if qe.act_scheme is not None else "high precision"
        assert f"{router}: weight {qe.weight_scheme}, input {act}" in said, said
