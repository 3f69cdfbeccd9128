"""GPTQ per expert (lowbit.algorithms.gptq.experts): statistics from the tokens routed to each
expert, checked against the routing the model's own router makes (captured independently, at
the router), the few-token rule, and the refusals."""
import copy
import math

import pytest
import torch

from lowbit.algorithms.gptq.experts import ExpertsCalibration, gptq_experts
from lowbit.archs.experts import spec_for
from lowbit.nn.experts import QuantExperts
from lowbit.pipelines.quantize_model import quantize_model
from lowbit.quantize import quantize
from lowbit.recipes.presets import get_recipe
from moe_fixtures import ids, tiny_moe

U64 = 2.0 ** -53


def _router_io(model, batches):
    """{router name: [(x [T, H] float64, top-k index [T, k])]} as each router sees them (a forward
    hook on the router: its input and its returned indices, not lowbit's capture)."""
    seen = {}
    hooks = []
    for n, m in model.named_modules():
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
            seen[n] = []
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, n=n: seen[n].append((a[0].reshape(-1, a[0].shape[-1]).double(), out[-1]))))
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _loss_and_bound(w, q, x):
    """sum_t ||(W - Q) x_t||^2 / n in float64, and a bound on its rounding error: each output
    entry is a K-term dot product (error <= gamma_K |D||x|), squared and summed over n N terms
    (gamma_{nN}); with A = sum_t (|D||x_t|)^2 / n the total is <= (2K + nN + 2) u A."""
    d = (w.double() - q.double())
    y, a = x @ d.T, (x.abs() @ d.abs().T)
    n = x.shape[0]
    return float(y.square().sum() / n), (2 * x.shape[1] + n * d.shape[0] + 2) * U64 * float(a.square().sum() / n)


def _glu(fmod, h):
    """The family's own activation of the gate_up output h (its module's code, not lowbit's)."""
    if hasattr(fmod, "_apply_gate"):                     # gpt-oss: interleaved, clamped swiglu
        return fmod._apply_gate(h)
    gate, up = h.chunk(2, dim=-1)
    return fmod.act_fn(gate) * up


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_each_expert_loss_on_its_routed_tokens_at_most_rtn(family, rng):
    """quantize_model(method="gptq") on a MoE model: for every expert of every block, the output
    loss of the stored codes on the tokens the router sent to it (the final model's router input
    and choice: sequential GPTQ calibrates each block on the already-quantized blocks before it)
    is at most round to nearest's -- for gate_up on those hidden states, for down on the family's
    activation of the stored gate_up's output (+ bias) -- and the report's token counts are the
    router's."""
    model = tiny_moe(family, rng, dtype=torch.float32)
    floats = {n: copy.deepcopy(m) for n, m in model.named_modules() if spec_for(m) is not None}
    specs = {n: spec_for(m) for n, m in floats.items()}
    calib = [ids(rng, 40), ids(rng, 33)]
    summary = quantize_model(model, "w4a16-g32", method="gptq", calib=calib,
                             method_options={"holdout": 0, "min_tokens": 6})
    scheme = get_recipe("w4a16-g32").weight
    io = _router_io(model, calib)
    gptq_total = rtn_total = 0.0
    for d in summary.experts:
        q, fmod, spec = model.get_submodule(d.name), floats[d.name], specs[d.name]
        assert isinstance(q, QuantExperts) and isinstance(d.calibration, ExpertsCalibration)
        router = d.name.rpartition(".")[0] + "." + spec.router
        x = torch.cat([a for a, _ in io[router]])
        idx = torch.cat([i for _, i in io[router]])
        nk = (lambda w: w) if spec.layout == "enk" else (lambda w: w.T)        # as [N, K]
        bias = getattr(fmod, spec.gate_up_bias).detach().double() if spec.gate_up_bias else None
        for fit in d.calibration.experts:
            e = fit.expert
            rows = (idx == e).any(dim=1)
            assert fit.tokens == int(rows.sum())
            if fit.tokens < 6:
                assert fit.choice == {"gate_up": "rtn: few tokens", "down": "rtn: few tokens"}
            xe = x[rows]
            q_gu = q.weight_q("gate_up", e).dequantize(torch.float64)
            xd = _glu(fmod, xe @ q_gu.T + (0 if bias is None else bias[e]))
            w_gu, w_dn = nk(fmod.gate_up_proj[e].detach()), nk(fmod.down_proj[e].detach())
            for w, qq, xin in ((w_gu, q_gu, xe), (w_dn, q.weight_q("down", e).dequantize(torch.float64), xd)):
                r = quantize(w.float(), scheme).dequantize(torch.float64)
                if xin.shape[0] == 0:
                    assert torch.equal(qq, r)           # no token: round to nearest's codes exactly
                    continue
                lq, bq = _loss_and_bound(w, qq, xin)
                lr, br = _loss_and_bound(w, r, xin)
                assert lq <= lr + bq + br, (d.name, e, lq, lr)
                gptq_total, rtn_total = gptq_total + lq, rtn_total + lr
    assert gptq_total <= rtn_total
    assert "GPTQ on" in str(summary) and "GPTQ per expert" in summary.experts[0].reason


def test_zero_and_few_token_experts_keep_rtn_and_are_listed(rng):
    """Expert 3 gets no token and expert 5 gets 4 (< min_tokens 8): both keep round to nearest's
    codes exactly and the report lists them with their counts; the others run GPTQ."""
    model = tiny_moe("mixtral", rng, dtype=torch.float32)
    mod = model.model.layers[0].mlp.experts
    T, E = 60, 8
    choices = [e for e in range(E) if e not in (3, 5)]
    first = torch.tensor([choices[t % len(choices)] for t in range(T)])
    second = torch.tensor([choices[(t + 1) % len(choices)] for t in range(T)])
    second[:4] = 5                                    # 4 tokens for expert 5
    idx = torch.stack([first, second], dim=1)
    x = torch.randn(T, 64, generator=rng)
    inputs = [(x[:37], idx[:37], torch.full((37, 2), 0.5)), (x[37:], idx[37:], torch.full((23, 2), 0.5))]
    r = get_recipe("w4a16-g32")
    q, cal = gptq_experts(mod, spec_for(mod), r.weight, r.act, inputs, name="L0", holdout=0, min_tokens=8)
    rtn = QuantExperts.from_module(mod, r.weight, r.act, **spec_for(mod).module_kwargs())
    assert cal.few() == [(3, 0), (5, 4)]
    for e in (3, 5):
        assert cal.experts[e].choice == {"gate_up": "rtn: few tokens", "down": "rtn: few tokens"}
        assert math.isnan(cal.experts[e].ratio["gate_up"])
        for p in ("gate_up", "down"):
            assert torch.equal(q.weight_q(p, e).codes, rtn.weight_q(p, e).codes)
            assert torch.equal(q.weight_q(p, e).scale, rtn.weight_q(p, e).scale)
    ran = [f for f in cal.experts if f.tokens >= 8]
    assert len(ran) == 6 and all(f.ratio["gate_up"] <= 1.0 or f.choice["gate_up"] == "rtn: fit loss" for f in ran)
    assert any(not torch.equal(q.weight_q("gate_up", f.expert).codes, rtn.weight_q("gate_up", f.expert).codes)
               for f in ran)
    assert "< 8 routed calibration tokens (expert: tokens) 3: 0, 5: 4" in str(cal)


def test_refusals_name_the_experts(rng):
    model = tiny_moe("qwen3_moe", rng, dtype=torch.float32)
    calib = [ids(rng, 8)]
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp\.experts.*targets='float'"):
        quantize_model(model, "w4a16-g32", method="gptq", calib=calib, method_options={"targets": "float"})
    mod = model.model.layers[0].mlp.experts
    r = get_recipe("w4a16-g32")
    with pytest.raises(ValueError, match="min_tokens=0"):
        gptq_experts(mod, spec_for(mod), r.weight, None, [(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long),
                                                             torch.ones(2, 2))], min_tokens=0)
    assert not any(isinstance(m, QuantExperts) for m in model.modules())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_awq_and_smoothquant_refuse_experts_by_name(family, rng):
    from lowbit.algorithms.awq import awq_model
    from lowbit.algorithms.smoothquant import smooth_model
    from lowbit.archs.decoders import UnsupportedArchitecture
    model = tiny_moe(family, rng, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedArchitecture, match=r"AWQ on .*model\.layers\.0\.mlp\.experts.*router"):
        awq_model(model, "w4a16-g32", [ids(rng, 8)])
    with pytest.raises(UnsupportedArchitecture, match=r"SmoothQuant on .*experts.*top-k"):
        smooth_model(model, [ids(rng, 8)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _moe_gptq(model, batches):
    """{buffer name: tensor} of every QuantExperts after GPTQ on `batches`, and the reports."""
    s = quantize_model(model, "w4a16-g32", method="gptq", calib=batches, method_options={"min_tokens": 12})
    bufs = {f"{n}.{b}": t for n, m in model.named_modules() if isinstance(m, QuantExperts)
            for b, t in m.named_buffers() if t is not None}
    return bufs, [str(d.calibration) for d in s.experts] + [
        f"projections kept GPTQ: {sum(c == 'gptq' for d in s.experts for f in d.calibration.experts for c in f.choice.values())}"]


def _dist_worker(rank: int, tmp: str, seed: int):
    import torch.distributed as dist
    from safetensors.torch import save_file
    from lowbit.algorithms.distributed import shard
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(seed)
        model = tiny_moe("mixtral", g, dtype=torch.float32)
        batches = [ids(g, 23) for _ in range(5)]
        bufs, reports = _moe_gptq(model, shard(batches))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in bufs.items()}, f"{tmp}/dist.safetensors")
            with open(f"{tmp}/reports.txt", "w") as f:
                f.write("\n".join(reports))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_single_process_experts(seed, tmp_path):
    """Each rank holds its share of 5 batches (3 and 2): the routed token counts, every expert's
    Hessian and held-out losses are reduced over the ranks in batch order, so every QuantExperts
    buffer is bit-identical to one process's with all batches, and so is the few-token report."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(seed)
        model = tiny_moe("mixtral", g, dtype=torch.float32)
        batches = [ids(g, 23) for _ in range(5)]
        one, reports = _moe_gptq(model, batches)
    finally:
        torch.set_num_threads(threads)
    mp.start_processes(_dist_worker, args=(str(tmp_path), seed), nprocs=2, join=True, start_method="fork")
    two = load_file(str(tmp_path / "dist.safetensors"))
    assert sorted(two) == sorted(one)
    differ = [k for k in one if not torch.equal(one[k], two[k])]
    assert not differ, f"buffers {differ} differ between 1 process and 2 ranks"
    assert (tmp_path / "reports.txt").read_text().split("\n") == reports
    assert reports[-1] != "projections kept GPTQ: 0"      # the comparison covers GPTQ's codes, not only RTN's


def test_mse_scales_for_experts_never_worse_than_rtn(rng):
    """mse=True: each expert's scales are lowbit.algorithms.scale_search's, which keep round to
    nearest's range on ties and minimise each scale's squared weight error, so every expert's
    weight error is <= round to nearest's (up to float64 summation order: the sums of N K squares
    differ by at most N K u of their value). GPTQ with mse runs on them per expert."""
    model = tiny_moe("qwen3_moe", rng, dtype=torch.float32)
    ref = copy.deepcopy(model)
    quantize_model(model, "w4a16-g32", mse=True)
    scheme = get_recipe("w4a16-g32").weight
    for n, f in ref.named_modules():
        if spec_for(f) is None:
            continue
        q = model.get_submodule(n)
        for p, w in (("gate_up", f.gate_up_proj), ("down", f.down_proj)):
            for e in range(w.shape[0]):
                we = w[e].detach().double()
                em = float((we - q.weight_q(p, e).dequantize(torch.float64)).square().sum())
                er = float((we - quantize(we.float(), scheme).dequantize(torch.float64)).square().sum())
                assert em <= er * (1 + we.numel() * U64), (n, p, e, em, er)
    g = copy.deepcopy(ref)
    s = quantize_model(g, "w4a16-g32", method="gptq", mse=True, calib=[ids(rng, 40)],
                       method_options={"min_tokens": 4})
    assert all(isinstance(g.get_submodule(d.name), QuantExperts) and d.calibration is not None for d in s.experts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the experts' GPTQ and routing report on the device")
def test_gptq_experts_and_routing_report_on_cuda(rng):
    """A CUDA model: GPTQ per expert and the routing report run with the model on the device
    (the exact path's float64 buffers on the host); every token's top-2 is counted once."""
    from lowbit.diagnosis.routing_report import routing_report
    model = tiny_moe("mixtral", rng, dtype=torch.float32).cuda()
    calib = [ids(rng, 40).cuda(), ids(rng, 33).cuda()]
    dev = copy.deepcopy(model)
    s_dev = quantize_model(dev, "w4a16-g32", method="gptq", calib=calib, method_options={"min_tokens": 6})
    assert all(sum(f.tokens for f in d.calibration.experts) == 2 * 73 for d in s_dev.experts)
    rep = routing_report(model, dev, calib)
    assert all(L.tokens == 73 for L in rep.layers)
    assert torch.isfinite(dev(ids(rng, 9).cuda()).logits).all()
