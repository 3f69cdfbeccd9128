"""Data-parallel calibration (lowbit.algorithms.distributed): a 2-process gloo run on the CPU, each rank
holding its contiguous share of the calibration batches, writes the same checkpoints as one
process with all the batches -- byte for byte -- for SmoothQuant + static scales (MAX
reductions), GPTQ and AWQ (ordered float64 Hessian sums), and the same per-site report up to
float64 summation rounding."""
import copy
import filecmp
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llama_fixtures import outlier_llama

from lowbit.pipelines.steps import GPTQ, SmoothQuant, StaticScales

WORLD = 2
N_BATCHES = 5            # odd: the ranks' shares differ in size (3 and 2)


def _setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    model = outlier_llama(g, intermediate_size=96)     # K = 64 and 96: whole groups of 32
    batches = [torch.randint(0, 97, (2, 19), generator=g) for _ in range(N_BATCHES)]
    return model, batches


def _terms(seed: int) -> list[torch.Tensor]:
    """Per-batch float64 terms whose sum depends on the order of additions: random magnitudes over
    16 decades, and element 0 = [1, 0, 0, 2^-53, 2^-53] by batch, which sums to 1 in batch order
    (each 1 + 2^-53 ties to even) but to 1 + 2^-52 when the last two are added first."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(N_BATCHES, 300, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-8, 9, (N_BATCHES, 300), generator=g)
    t[:, 0] = torch.tensor([1.0, 0.0, 0.0, 2.0 ** -53, 2.0 ** -53], dtype=torch.float64)
    return list(t)


def _pipeline(model, batches, out: Path | None) -> dict:
    """The library's calibration calls on `batches` (this rank's share under torch.distributed);
    checkpoints written to `out` when given. Returns the per-site SQNRs."""
    from lowbit.pipelines.checkpoint import save_compressed
    from lowbit.algorithms.awq import awq_model
    from lowbit.algorithms.static_scales import calibrate_static_scales
    from lowbit.pipelines.quantize_model import quantize_model
    from lowbit.recipes.presets import get_recipe
    from lowbit.diagnosis.sites import site_report
    from lowbit.algorithms.smoothquant import smooth_model

    sites = site_report(model, batches, "w8a8-int8")
    m = copy.deepcopy(model)
    smooth_model(m, batches, alpha=0.5)
    scales = calibrate_static_scales(m, batches, get_recipe("w8a8-int8").act)
    quantize_model(m, "w8a8-int8", act_static_scales=scales)
    runs = {"smoothquant-static": m}
    m = copy.deepcopy(model)
    gptq = quantize_model(m, "w4a16-g32", method="gptq", calib=batches)
    runs["gptq"] = m
    m = copy.deepcopy(model)
    awq_model(m, "w4a16-g32", batches)
    quantize_model(m, "w4a16-g32")
    runs["awq"] = m
    if out is not None:
        for name, mm in runs.items():
            save_compressed(mm, out / name, config={})
    # GPTQ's losses (fit tokens: by row panels over the ranks; held-out: by batches) as reported
    reasons = [d.reason for d in gptq.quantized]
    return {"tokens": sites.tokens, "gptq_reasons": reasons,
            **{r.name: [r.act_db, r.weight_db, r.out_db, r.block_db] for r in sites.rows}}


def _layerwise(src: Path, batches, out: Path) -> None:
    """Layer by layer from the sharded float checkpoint: SmoothQuant + static scales + W8A8 RTN
    (under torch.distributed: each rank reads a share of every layer, which the ranks exchange,
    quantizes a share of the Linears and sends rank 0 the codes; rank 0 writes), and GPTQ W4A16
    (rows and H^-1's factor panels split over the ranks; the writer thread packs the codes)."""
    from lowbit.pipelines.layerwise import quantize_layerwise
    quantize_layerwise(src, out, "w8a8-int8", batches, steps=[SmoothQuant(0.5), StaticScales()])
    quantize_layerwise(src, out.parent / "layerwise-gptq", "w4a16-g32", batches, steps=[GPTQ()])


def _factor_bytes(seed: int) -> bytes:
    """GPTQ's factor of H^-1 (gptq._factor) of a random K = 50 Hessian with a dead column, as
    raw float64 bytes: under torch.distributed each rank computes a share of its panels."""
    from lowbit.algorithms import distributed
    from lowbit.algorithms.gptq import factor as gptq
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(80, 50, generator=g, dtype=torch.float64)
    x[:, 7] = 0
    fac = gptq._factor(x.T @ x / 80, 0.01, True, torch.device("cpu"), distributed.world_size(), distributed.rank())
    return fac.hinv.numpy().tobytes()


def _worker(rank: int, tmp: str, seed: int):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)       # the same matmul kernels as the single-process run
        from lowbit.algorithms.distributed import ChunkedSum, OrderedSum, counts, shard
        acc = OrderedSum()
        for t in shard(_terms(seed)):
            acc.add(t)
        total = acc.total((300,))
        # chunks of 2 batches (5 batches, 4 chunks): rank 1's first batch (3) continues the chunk
        # [2, 4) that rank 0 began, on the chain
        chunked = ChunkedSum(counts(len(shard(_terms(seed)))), (300,), "cpu")
        for t in shard(_terms(seed)):
            chunked.add(lambda s, t=t: s.add_(t))
        chunked_total = chunked.total()
        model, batches = _setup(seed)
        sites = _pipeline(model, shard(batches), Path(tmp) / "dist" if rank == 0 else None)
        _layerwise(Path(tmp) / "float", shard(batches), Path(tmp) / "dist" / "layerwise")
        factor = _factor_bytes(seed)
        if rank == 0:
            (Path(tmp) / "factor.f64").write_bytes(factor)
            (Path(tmp) / "sites.json").write_text(json.dumps(sites))
            (Path(tmp) / "ordered_sum.f64").write_bytes(total.numpy().tobytes())
            (Path(tmp) / "chunked_sum.f64").write_bytes(chunked_total.numpy().tobytes())
    finally:
        dist.destroy_process_group()


def _same_dirs(a: Path, b: Path) -> list[str]:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    return [n for n in names if not filecmp.cmp(a / n, b / n, shallow=False)]


def test_two_gloo_ranks_write_the_single_process_checkpoints(seed, tmp_path, monkeypatch):
    # GPTQ's row panels small enough that every job (q/k/v 128 rows, gate/up 192, o and down 64)
    # is split between the two ranks, and H^-1's factor in 4 (K = 50, 64) or 6 (K = 96) column
    # panels, which the ranks share out (the forked ranks inherit the settings)
    from lowbit.algorithms.gptq import factor, hessian
    monkeypatch.setattr(hessian, "PANEL_ROWS", 16)
    monkeypatch.setattr(factor, "FACTOR_PANEL", 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batches = _setup(seed)
        # several shards, so that a rank's share of a layer spans files
        model.save_pretrained(tmp_path / "float", max_shard_size="40KB")
        sites = _pipeline(model, batches, tmp_path / "single")
        _layerwise(tmp_path / "float", batches, tmp_path / "single" / "layerwise")
        factor = _factor_bytes(seed)
    finally:
        torch.set_num_threads(threads)
    # fork: the ranks start with transformers already imported (spawn would spend ~10 s per rank
    # importing it on a loaded 2-core CI machine); they compute with 1 thread, no OpenMP pool.
    mp.start_processes(_worker, args=(str(tmp_path), seed), nprocs=WORLD, join=True, start_method="fork")
    for run in ("smoothquant-static", "gptq", "awq", "layerwise", "layerwise-gptq"):
        differ = _same_dirs(tmp_path / "single" / run, tmp_path / "dist" / run)
        assert not differ, f"{run}: files {differ} differ between 1 process and {WORLD} ranks"
    assert (tmp_path / "factor.f64").read_bytes() == factor, "H^-1's factor differs between 1 process and 2 ranks"
    terms = _terms(seed)
    one = torch.zeros(300, dtype=torch.float64)
    for t in terms:
        one += t
    two = torch.frombuffer(bytearray((tmp_path / "ordered_sum.f64").read_bytes()), dtype=torch.float64)
    assert torch.equal(two, one), "OrderedSum over 2 ranks is not the 1-process sum"
    split = (torch.zeros(300, dtype=torch.float64) + terms[0] + terms[1] + terms[2]) + (
        torch.zeros(300, dtype=torch.float64) + terms[3] + terms[4])
    assert not torch.equal(split, one)     # why the order matters: ranks' partial sums added differ
    # ChunkedSum's canonical order: chunks of ceil(5 / CHAIN_CHUNKS) = 2 batches, each from zero,
    # the chunks' sums added in order
    from lowbit.algorithms.distributed import CHAIN_CHUNKS
    c = -(-N_BATCHES // CHAIN_CHUNKS)
    sums = [sum(terms[a:a + c], torch.zeros(300, dtype=torch.float64)) for a in range(0, N_BATCHES, c)]
    want = sums[0]
    for x in sums[1:]:
        want = want + x
    two = torch.frombuffer(bytearray((tmp_path / "chunked_sum.f64").read_bytes()), dtype=torch.float64)
    assert torch.equal(two, want), "ChunkedSum over 2 ranks is not its 1-process order"
    got = json.loads((tmp_path / "sites.json").read_text())
    assert got.pop("tokens") == sites.pop("tokens")
    assert got.pop("gptq_reasons") == sites.pop("gptq_reasons")     # the same losses, to the printed digit
    assert sorted(got) == sorted(sites)
    # Each site sum (signal or noise) adds N_BATCHES positive float64 terms, in another order under
    # 2 ranks: each path's sum is within (N_BATCHES - 1) u64 relative of the exact one (u64 = 2^-53),
    # so the two differ by <= 2 (N_BATCHES - 1) u64 relative; dB = 10 log10(S / N) then moves by
    # <= 10 / ln 10 * (that for S + that for N), plus the division and log10 rounding of both
    # paths (<= 2 ulp of the result each: 4 u64 |dB|).
    u = 2.0 ** -53
    for name, want in sites.items():
        for g, w in zip(got[name], want):
            if math.isnan(w) or math.isinf(w):
                assert g == w or (math.isnan(g) and math.isnan(w)), (name, g, w)
                continue
            tol = 10 / math.log(10) * 2 * 2 * (N_BATCHES - 1) * u + 4 * u * abs(w)
            assert abs(g - w) <= tol, (name, g, w, tol)


def test_shard_is_contiguous_and_balanced(monkeypatch):
    from lowbit.algorithms import distributed as D
    items = list(range(7))
    parts = []
    for r in range(3):
        monkeypatch.setattr(D, "rank", lambda r=r: r)
        monkeypatch.setattr(D, "world_size", lambda: 3)
        parts.append(D.shard(items))
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    monkeypatch.setattr(D, "world_size", lambda: 8)
    with pytest.raises(ValueError, match="at least one batch per rank"):
        D.shard(items)


def test_owners_longest_first_to_the_least_loaded():
    from lowbit.algorithms.distributed import owners
    # by hand: 16 -> rank 1 (tie: the highest rank), 9 -> 0, 4 -> 0 (9 < 16), 1 -> 0 (13 < 16)
    assert owners([16.0, 9.0, 4.0, 1.0], 2) == [1, 0, 0, 0]
    # 3 ranks: 5 -> 2, 5 -> 1, 4 -> 0, 3 -> 0 (4 < 5), 2 -> 2 (loads 7, 5, 5: the tie to the highest)
    assert owners([3.0, 5.0, 2.0, 5.0, 4.0], 3) == [0, 2, 2, 1, 0]
    assert owners([1.0, 2.0], 1) == [0, 0]


def test_reductions_are_identity_without_a_group():
    from lowbit.algorithms import distributed as D
    assert not D.active()
    t = torch.randn(5, dtype=torch.float64)
    assert D.all_max(t) is t and D.all_sum(t) is t and D.all_count(3) == 3
    s = D.OrderedSum()
    s.add(t)
    s.add(t)
    assert torch.equal(s.total((5,)), torch.zeros(5, dtype=torch.float64) + t + t)
    with pytest.raises(TypeError, match="float64"):
        s.add(t.float())
    # one process: chunks of ceil(3 / CHAIN_CHUNKS) terms, each summed from zero, then added in order
    c = D.ChunkedSum(D.counts(3), (5,), "cpu", chunks=2)
    u = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    for x in u:
        c.add(lambda acc, x=x: acc.add_(x))
    assert torch.equal(c.total(), (torch.zeros(5, dtype=torch.float64) + u[0] + u[1]) + (torch.zeros(5, dtype=torch.float64) + u[2]))
    with pytest.raises(RuntimeError, match="more terms"):
        c.add(lambda acc: acc.add_(u[0]))
    with pytest.raises(RuntimeError, match="torchrun"):
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        D.init_from_env("cpu")
