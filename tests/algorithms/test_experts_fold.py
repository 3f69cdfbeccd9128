"""AWQ and SmoothQuant on the experts' down side (lowbit.algorithms.experts_fold): the fold leaves the model's
function unchanged, each expert's quantized down_proj output error on its routed tokens is no
larger than without AWQ, too-few-token experts are left alone, and what cannot fold is refused."""
import copy

import pytest
import torch

from lowbit.algorithms.experts_fold import awq_experts, smooth_experts
from lowbit.archs.decoders import UnsupportedArchitecture
from lowbit.quantize import quantize
from lowbit.recipes.presets import get_recipe
from moe_fixtures import ids, tiny_moe

U64 = 2.0 ** -53


def _routed(model, batches):
    """{experts name: (x [T, H] float64, top-k index [T, k])}, from hooks on the routers."""
    got, hooks = {}, []
    for n, m in model.named_modules():
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter")):
            got[n] = []
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, n=n: got[n].append((a[0].reshape(-1, a[0].shape[-1]).double(), out[-1]))))
    with torch.no_grad():
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    return {n[:-len("gate")] + "experts": (torch.cat([x for x, _ in v]), torch.cat([i for _, i in v]))
            for n, v in got.items()}


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fold_is_exact_and_down_error_not_larger(family, rng):
    """Logits: every folded weight moves by <= 1 ulp (u = 2^-53 relative) and each expert output
    by <= (K + 2) u of its magnitude; two random-weight layers amplify a relative perturbation by
    far less than 2^7 (as tests/pipelines/test_quantize_moe.py argues), so |dlogits| <= 2^-39
    max|logit|. Down error: alpha = 0 (s = 1) is on the search grid, so the chosen s has an output
    loss on the expert's tokens no larger than no AWQ, up to the float64 rounding of both sums
    (<= (2K + nN + 2) u of the sum of |terms|, bounded here by 1e-9 relative)."""
    model = tiny_moe(family, rng)                                     # float64
    ref = copy.deepcopy(model)
    batches = [ids(rng, 40), ids(rng, 30)]
    done = awq_experts(model, "w4a16-g32", batches, min_tokens=4)
    test_ids = ids(rng, 11)
    with torch.no_grad():
        a, b = ref(test_ids).logits, model(test_ids).logits
    assert (a - b).abs().max() <= 2.0 ** -39 * a.abs().max()
    scheme = get_recipe("w4a16-g32").weight
    routed = _routed(ref, batches)
    moved = 0
    for n, info in done.items():
        x, idx = routed[n]
        f, g = ref.get_submodule(n), model.get_submodule(n)
        I = f.down_proj.shape[2]
        for e, alpha in enumerate(info["alpha"]):
            rows = (idx == e).any(dim=1)
            assert info["tokens"][e] == int(rows.sum())
            if alpha is None:
                assert torch.equal(f.down_proj[e], g.down_proj[e]) and torch.equal(f.gate_up_proj[e], g.gate_up_proj[e])
                continue
            moved += alpha > 0
            # the folded factor read back from down (one rounding of f * s, one of the division: <= 2u off),
            # times up's row (one rounding of f / s, one of the product): within 6u of the float row
            s = g.down_proj[e][0] / f.down_proj[e][0]
            assert torch.allclose(g.gate_up_proj[e][I:] * s[:, None], f.gate_up_proj[e][I:], rtol=6 * U64, atol=0)
            assert torch.equal(g.gate_up_proj[e][:I], f.gate_up_proj[e][:I])        # gate rows untouched
            h = x[rows] @ f.gate_up_proj[e].T
            act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            losses = []
            for w, xin in ((f.down_proj[e], act), (g.down_proj[e], act / s)):
                d = w - quantize(w.float(), scheme).dequantize(torch.float64)
                losses.append(float((xin @ d.T).square().sum()))
            assert losses[1] <= losses[0] * (1 + 1e-9), (n, e, losses)
    assert moved > 0


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_smoothquant_balances_each_experts_down_input_and_weight(family, rng):
    """alpha = 0.5: s_j = sqrt(max|a_j| / max|W_:,j|), so after the fold the expert's down input
    and weight have the same maximum per channel, max|a_j| / s_j = max|W_:,j| s_j up to the
    float32 arithmetic of s (lowbit.algorithms.smoothquant.smoothing_factors: the cast of max|a_j|,
    two powers and a quotient, each <= 2 ulps of 2^-24, so s^2 is within ~12 * 2^-24 < 2^-19
    relative of max|a_j| / max|W_:,j|); logits unchanged (bound as in the AWQ test)."""
    model = tiny_moe(family, rng)
    ref = copy.deepcopy(model)
    batches = [ids(rng, 30), ids(rng, 25)]
    done = smooth_experts(model, batches, alpha=0.5, min_tokens=3)
    test_ids = ids(rng, 9)
    with torch.no_grad():
        a, b = ref(test_ids).logits, model(test_ids).logits
    assert (a - b).abs().max() <= 2.0 ** -39 * a.abs().max()
    routed = _routed(ref, batches)
    checked = 0
    for n, info in done.items():
        x, idx = routed[n]
        f, g = ref.get_submodule(n), model.get_submodule(n)
        I = f.down_proj.shape[2]
        for e, s in enumerate(info["s"]):
            rows = (idx == e).any(dim=1)
            assert info["tokens"][e] == int(rows.sum())
            if s is None:
                continue
            h = x[rows] @ g.gate_up_proj[e].T                        # the folded expert's own down input
            act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            amax, wmax = act.abs().amax(dim=0), g.down_proj[e].abs().amax(dim=0)
            assert torch.allclose(amax, wmax, rtol=2.0 ** -19, atol=0), (n, e)
            checked += 1
    assert checked > 0


def test_few_token_experts_untouched_and_refusals(rng):
    model = tiny_moe("mixtral", rng)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    done = awq_experts(model, "w4a16-g32", [ids(rng, 8)], min_tokens=10 ** 6)
    assert all(a is None for d in done.values() for a in d["alpha"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="weight-only"):
        awq_experts(model, "w8a8-int8", [ids(rng, 8)])
    with pytest.raises(UnsupportedArchitecture, match=r"gpt_oss.*clamp"):
        awq_experts(tiny_moe("gpt_oss", rng), "w4a16-g32", [ids(rng, 8)])
    from lowbit.algorithms.awq import awq_model
    from lowbit.algorithms.smoothquant import smooth_model
    with pytest.raises(UnsupportedArchitecture, match="awq_experts"):
        awq_model(model, "w4a16-g32", [ids(rng, 8)])
    with pytest.raises(UnsupportedArchitecture, match="smooth_experts"):
        smooth_model(model, [ids(rng, 8)])
    with pytest.raises(UnsupportedArchitecture, match=r"SmoothQuant.*gpt_oss.*clamp"):
        smooth_experts(tiny_moe("gpt_oss", rng), [ids(rng, 8)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _folds(model, batches):
    """Parameters of two copies of `model` after awq_experts and smooth_experts on `batches`."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    awq_experts(a, "w4a16-g32", batches, min_tokens=8)
    smooth_experts(b, batches, alpha=0.5, min_tokens=8)
    return {**{"awq." + n: p.detach() for n, p in a.named_parameters()},
            **{"sq." + n: p.detach() for n, p in b.named_parameters()}}


def _dist_worker(rank: int, tmp: str, seed: int):
    import torch.distributed as dist
    from safetensors.torch import save_file
    from lowbit.algorithms.distributed import shard
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(seed)
        model = tiny_moe("qwen3_moe", g)
        batches = [ids(g, 17) for _ in range(5)]
        params = _folds(model, shard(batches))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in params.items()}, f"{tmp}/dist.safetensors")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_fold_what_one_process_folds(seed, tmp_path):
    """Ranks holding 3 and 2 of 5 batches: token counts summed, SmoothQuant maxima and AWQ's
    float64 sums reduced in batch order, so every folded parameter is bit-identical."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(seed)
        model = tiny_moe("qwen3_moe", g)
        batches = [ids(g, 17) for _ in range(5)]
        one = _folds(model, batches)
    finally:
        torch.set_num_threads(threads)
    mp.start_processes(_dist_worker, args=(str(tmp_path), seed), nprocs=2, join=True, start_method="fork")
    two = load_file(str(tmp_path / "dist.safetensors"))
    assert sorted(two) == sorted(one)
    differ = [k for k in one if not torch.equal(one[k], two[k])]
    assert not differ, f"parameters {differ} differ between 1 process and 2 ranks"
    assert not torch.equal(one["awq.model.layers.0.mlp.experts.down_proj"], model.model.layers[0].mlp.experts.down_proj)
