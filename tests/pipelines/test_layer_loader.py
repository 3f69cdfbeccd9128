"""lowbit.pipelines.layer_loader (a layer's tensors read in per-rank shares, the embedding rows of the
calibration tokens) and lowbit.profiling.memtrace's replay of an allocator trace. The 2-rank exchange
itself is checked end to end in tests/algorithms/test_distributed.py (byte-identical checkpoints)."""
import pytest
import torch


def _checkpoint(rng, tmp_path, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=int(torch.randint(40, 90, (1,), generator=rng)), hidden_size=48,
                      intermediate_size=int(torch.randint(50, 130, (1,), generator=rng)), num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    m = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(generator=rng)           # no all-equal norms: every element tells
    m.save_pretrained(tmp_path, max_shard_size="20KB")
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shares_cover_each_element_once_and_read_back_exactly(rng, tmp_path, dtype):
    from lowbit.pipelines import layer_loader as LL
    m = _checkpoint(rng, tmp_path, dtype)
    ck = LL.Checkpoint(tmp_path)
    layer = m.model.layers[1]
    params = dict(layer.named_parameters())
    try:
        for world in (1, 2, 3, 7):
            pieces = LL.plan(layer, "model.layers.1.", ck, world)
            seen = {k: torch.zeros(p.numel(), dtype=torch.int64) for k, p in params.items()}
            loads = [0] * world
            for pc in pieces:
                seen[pc.param][pc.lo:pc.hi] += 1
                loads[pc.owner] += pc.hi - pc.lo
            assert all(bool((s == 1).all()) for s in seen.values())
            assert max(loads) - min(loads) <= 1          # balanced by elements (= bytes)
            # each rank's pieces, read as that rank would, are the checkpoint's bytes
            got = {k: torch.full((p.numel(),), float("nan"), dtype=torch.float32) for k, p in params.items()}
            with torch.no_grad():
                for r in range(world):
                    from unittest import mock
                    with mock.patch.object(LL.distributed, "rank", lambda r=r: r):
                        from concurrent.futures import ThreadPoolExecutor
                        with ThreadPoolExecutor(2) as pool:
                            host, _ = LL.read_pieces(pieces, ck, torch.float32, pool)
                    for pc, t in host:
                        got[pc.param][pc.lo:pc.hi] = t
            for k, p in params.items():
                assert torch.equal(got[k], p.detach().float().reshape(-1)), (world, k)
    finally:
        ck.close()


def test_read_rows_is_the_row_gather(rng, tmp_path):
    from lowbit.pipelines import layer_loader as LL
    m = _checkpoint(rng, tmp_path, torch.bfloat16)
    table = m.model.embed_tokens.weight.detach()
    ids = torch.randint(0, table.shape[0], (3, 17), generator=rng)
    rows, inv = torch.unique(ids, sorted=True, return_inverse=True)
    ck = LL.Checkpoint(tmp_path)
    try:
        got = LL.read_rows(ck, "model.embed_tokens.weight", rows)
        assert torch.equal(got[inv], table[ids])
        with pytest.raises(ValueError, match="token ids must lie"):
            LL.read_rows(ck, "model.embed_tokens.weight", torch.tensor([0, table.shape[0]]))
    finally:
        ck.close()


def test_memtrace_names_what_is_alive_at_the_peak():
    from lowbit.profiling.memtrace import summarize
    f = lambda path, line: [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},  # noqa: E731
                            {"filename": path, "line": line, "name": "fn"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 50, "frames": f("/src/lowbit/nn/a.py", 10)},
        {"action": "alloc", "addr": 2, "size": 30, "frames": f("/py/transformers/models/llama.py", 5)
         + [{"filename": "/src/lowbit/nn/z.py", "line": 3, "name": "run"}]},
        {"action": "free_requested", "addr": 1, "size": 50},
        {"action": "free_completed", "addr": 1, "size": 50},
        {"action": "free_completed", "addr": 99, "size": 20},      # allocated before the trace
        {"action": "alloc", "addr": 3, "size": 70, "frames": f("/src/lowbit/nn/b.py", 7)},
        {"action": "alloc", "addr": 4, "size": 5, "frames": f("/src/lowbit/nn/b.py", 7)},
        {"action": "free_completed", "addr": 3, "size": 70},
    ]
    # running total from 100: 150, 180, 180, 130, 110, 180, 185 (peak, entry 6), 115
    s = summarize(trace, 100)
    assert s["peak_bytes"] == 185 and s["peak_entry"] == 6
    rows = {r["where"]: (r["bytes"], r["blocks"]) for r in s["live_at_peak"]}
    assert rows == {"lowbit/nn/b.py:7 fn": (75, 2), "transformers/models/llama.py:5 fn < lowbit/nn/z.py:3 run": (30, 1),
                    "allocated before the trace began, still alive": (80, None)}
    assert sum(b for b, _ in rows.values()) == s["peak_bytes"]
    assert [b["bytes"] for b in s["largest_blocks"]] == [70, 30, 5]
    assert s["largest_blocks"][1]["stack"][1:] == ["transformers/models/llama.py:5 fn", "lowbit/nn/z.py:3 run"]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_moe_layer_is_read_from_the_per_expert_tensors(family, rng, tmp_path):
    """transformers 5 keeps a block's experts fused in memory but saves them one tensor per expert
    and projection (its conversion mapping, reversed; Mixtral under block_sparse_moe and
    w1/w3/w2). checkpoint_sources names exactly the tensors save_pretrained wrote for each fused
    weight, and a MoE layer read through model_sources, in every rank's share, is the model's
    own parameters and persistent buffers (DeepSeek-V3's e_score_correction_bias) bit for bit."""
    from concurrent.futures import ThreadPoolExecutor
    from unittest import mock
    from moe_fixtures import tiny_moe
    from lowbit.archs.experts import checkpoint_sources
    from lowbit.io.st_format import checkpoint_files
    from lowbit.pipelines import layer_loader as LL
    from lowbit.pipelines.moe_checkpoint import experts_sites
    m = tiny_moe(family, rng, dtype=torch.bfloat16, experts=4)
    with torch.no_grad():
        for b in m.buffers():             # no all-zero buffer: every element tells
            if b.is_floating_point():
                b.normal_(generator=rng)
    m.save_pretrained(tmp_path, max_shard_size="30KB")
    on_disk = set(checkpoint_files(tmp_path))
    sites = experts_sites(m)
    named = set()
    for name, site in sites.items():
        for attr in site.spec.weights:
            p = getattr(site.module, attr)
            srcs = checkpoint_sources(site.spec, site.ckpt, attr, tuple(p.shape))
            named.update(n for n, _ in srcs)
    assert named and named == {n for n in on_disk if ".experts." in n}
    ck = LL.Checkpoint(tmp_path)
    try:
        sources = LL.model_sources(m, ck)
        for i, layer in enumerate(m.model.layers):
            want = LL.tensors(layer)
            assert any(".experts." in k for k in want) or family == "deepseek_v3"
            for world in (1, 3):
                pieces = LL.plan(layer, f"model.layers.{i}.", ck, world, sources)
                got = {k: torch.full((t.numel(),), float("nan"), dtype=torch.float32) for k, t in want.items()}
                for r in range(world):
                    with mock.patch.object(LL.distributed, "rank", lambda r=r: r), ThreadPoolExecutor(2) as pool:
                        host, _ = LL.read_pieces(pieces, ck, torch.float32, pool)
                    for pc, t in host:
                        assert bool(got[pc.param][pc.lo:pc.hi].isnan().all())      # each element once
                        got[pc.param][pc.lo:pc.hi] = t
                for k, t in want.items():
                    assert torch.equal(got[k], t.detach().float().reshape(-1)), (family, i, world, k)
    finally:
        ck.close()
