"""Layer-by-layer calibration on 1 vs N processes (scripts/gpu_distributed.sh drives it).

  make     a random-weight Llama checkpoint, one safetensors file per decoder layer (so that
           `view` can make a shorter model of the same layers without copying a byte)
  view     DIR with the first N layers of a `make` checkpoint (hard links + its own index)
  run      lowbit.pipelines.layerwise.quantize_layerwise on random calibration ids; under torchrun
           the ids are split across ranks (lowbit.algorithms.distributed.shard) and rank 0 writes;
           every rank writes its own JSON (wall time, peak memory)
  compare  whether two checkpoint directories are byte-identical (and, if not, which tensors
           and how many of their elements differ)
Everything runs on the CPU too (gloo), which is how the GPU script is tested before its one run.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _config(a) -> dict:
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(2048, a.max_positions), rms_norm_eps=1e-5,
                      tie_word_embeddings=False).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[a.dtype]
    return cfg


def _write_part(directory: Path, fname: str, tensors) -> list[str]:
    """One safetensors file of `tensors` (name, tensor) by lowbit's writer; returns the names."""
    from lowbit.io.st_format import ShardedWriter
    tmp = directory / (fname + ".d")
    tmp.mkdir()
    w = ShardedWriter(tmp, 1 << 62)
    names = []
    for n, t in tensors:
        w.add(n, t)
        names.append(n)
    w.finish()
    os.replace(tmp / "model.safetensors", directory / fname)
    tmp.rmdir()
    return names


def make(a) -> None:
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = _config(a)
    dev, dt = torch.device(a.device), DTYPES[a.dtype]
    g = torch.Generator(device=dev).manual_seed(a.seed)
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    H, I, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * head

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * std).to(dt).cpu()

    t0 = time.time()
    index = {}
    index.update({n: "embed.safetensors" for n in _write_part(out, "embed.safetensors",
                                                              [("model.embed_tokens.weight", rnd(a.vocab, H))])})
    for i in range(a.layers):
        p = f"model.layers.{i}."
        ts = [(p + "input_layernorm.weight", torch.ones(H, dtype=dt)),
              (p + "post_attention_layernorm.weight", torch.ones(H, dtype=dt)),
              (p + "self_attn.q_proj.weight", rnd(H, H)), (p + "self_attn.k_proj.weight", rnd(kv, H)),
              (p + "self_attn.v_proj.weight", rnd(kv, H)), (p + "self_attn.o_proj.weight", rnd(H, H)),
              (p + "mlp.gate_proj.weight", rnd(I, H)), (p + "mlp.up_proj.weight", rnd(I, H)),
              (p + "mlp.down_proj.weight", rnd(H, I))]
        f = f"layer-{i:05d}.safetensors"
        index.update({n: f for n in _write_part(out, f, ts)})
        print(f"layer {i + 1}/{a.layers} written ({time.time() - t0:.0f} s)", flush=True)
    index.update({n: "head.safetensors" for n in _write_part(
        out, "head.safetensors", [("model.norm.weight", torch.ones(H, dtype=dt)), ("lm_head.weight", rnd(a.vocab, H))])})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"checkpoint {out}: {a.layers} layers, {size / 2**30:.2f} GiB in {time.time() - t0:.0f} s", flush=True)


def view(a) -> None:
    """The first a.layers layers of a `make` checkpoint, by hard links (no copy)."""
    src, out = Path(a.src), Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if a.layers > cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers {a.layers} > the checkpoint's {cfg['num_hidden_layers']}")
    cfg["num_hidden_layers"] = a.layers
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    keep = {n: f for n, f in wm.items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < a.layers}
    for f in sorted(set(keep.values())):
        try:
            os.link(src / f, out / f)
        except OSError:          # a filesystem without hard links: copy
            shutil.copy2(src / f, out / f)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def run(a) -> None:
    # imported before the clock starts (seconds on a cold disk; transformers imports the model
    # class lazily, on first use), so that the wall time is the quantization's
    import transformers
    transformers.AutoConfig, transformers.LlamaForCausalLM  # noqa: B018
    import lowbit.algorithms.static_scales, lowbit.algorithms.gptq, lowbit.algorithms.smoothquant, lowbit.pipelines.checkpoint  # noqa: E401,F401
    if a.device == "cuda":
        import lowbit.algorithms.gptq.block  # noqa: F401  (triton)
    from lowbit.algorithms import distributed as D
    from lowbit.pipelines.layerwise import quantize_layerwise
    from lowbit.workflows.job import Measures
    dev = "cpu"
    if D.launched_by_torchrun():
        dev = D.init_from_env(a.device)
    elif a.device == "cuda":
        dev = "cuda:0"
    torch.manual_seed(0)
    if a.terms_on_host:
        D.TERMS_ON_HOST = True
    if dev == "cpu":
        torch.set_num_threads(a.threads)
    cfg = json.loads((Path(a.ckpt) / "config.json").read_text())
    g = torch.Generator().manual_seed(a.seed)
    batches = [torch.randint(0, cfg["vocab_size"], (a.batch, a.seq_len), generator=g) for _ in range(a.batches)]
    mine = D.shard(batches)
    opts = {"steps": Measures(smoothquant=a.smoothquant, static=a.static, method=a.method).steps()}
    if D.active():
        import torch.distributed as dist
        dist.barrier()
    t0 = time.time()
    res = quantize_layerwise(a.ckpt, a.out, a.recipe, mine, device=dev, dtype=DTYPES[a.dtype], overwrite=True,
                             memory_trace_layer=a.memory_trace_layer, profile_layer=a.profile_layer, **opts)
    wall = time.time() - t0
    res.update(wall_s=wall, rank=D.rank(), device=str(dev), batches=len(mine), tokens=sum(b.numel() for b in mine),
               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               batch_shape=[a.batch, a.seq_len], world=D.world_size(), terms_on_host=a.terms_on_host)
    res.pop("quantized", None)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{a.json}.rank{D.rank()}.json").write_text(json.dumps(res, indent=1))
    peak = res.get("peak_device_bytes", res["peak_rss_over_start_bytes"])
    print(f"rank {D.rank()}/{D.world_size()} {a.recipe} {a.method}: {wall:.1f} s, peak "
          f"{peak / 2**30:.2f} GiB, layer {res['layer_bytes'] / 2**30:.3f} GiB, activations "
          f"{res['activation_bytes'] / 2**30:.3f} GiB; phases "
          + ", ".join(f"{k} {v:.1f} s" for k, v in res["phase_seconds"].items())
          + ("; GPTQ " + ", ".join(f"{k} {v:.1f} s" for k, v in res["gptq_phase_seconds"].items())
             + f"; block kernel {res['gptq_block_kernel']}" if "gptq_phase_seconds" in res else "")
          + "; threads " + ", ".join(f"{k} {v:.1f} s" for k, v in res["thread_seconds"].items())
          + ("; peak GiB by phase " + ", ".join(f"{k} {v['peak'] / 2**30:.2f} (layer {v['layer']})"
                                               for k, v in res["phase_peak_bytes"].items())
             if "phase_peak_bytes" in res else ""), flush=True)
    pr = res.get("profile")
    if pr:
        print(f"rank {D.rank()}/{D.world_size()} profile of layer {pr['layer']}: device {pr['total_self_device_s']:.3f} s, "
              f"CPU {pr['total_self_cpu_s']:.3f} s, {pr['launches']} launches; top by device time: "
              + "; ".join(f"{x['op'][:40]} x{x['count']} {x['self_device_us'] / 1e3:.1f} ms"
                          for x in pr["by_device_time"][:12]), flush=True)
    tr = res.get("memory_trace")
    if tr:
        print(f"rank {D.rank()}/{D.world_size()} memory trace of layer {tr.get('layer')}: "
              + (tr["error"] if "error" in tr else
                 f"peak {tr['peak_bytes'] / 2**30:.3f} GiB; alive then: "
                 + "; ".join(f"{x['where']} {x['bytes'] / 2**20:.0f} MiB" for x in tr["live_at_peak"][:8])), flush=True)
    if D.active():
        import torch.distributed as dist
        dist.destroy_process_group()


def compare(a) -> int:
    """0 when the two checkpoint directories hold byte-identical files."""
    x, y = Path(a.a), Path(a.b)
    fx, fy = sorted(p.name for p in x.iterdir()), sorted(p.name for p in y.iterdir())
    ignore = {"lowbit-files.json"}
    differ = [] if fx == fy else ["<file lists differ>"]
    if not differ:
        differ = [f for f in fx if f not in ignore and not filecmp.cmp(x / f, y / f, shallow=False)]
    rep = {"a": str(x), "b": str(y), "identical": not differ, "differing_files": differ, "tensors": {}}
    if differ and fx == fy:      # which tensors, how many elements
        from lowbit.io.st_format import TensorReader, checkpoint_files
        cx, cy = checkpoint_files(x), checkpoint_files(y)
        for n in sorted(set(cx) & set(cy)):
            with TensorReader(cx[n]) as rx, TensorReader(cy[n]) as ry:
                u, v = rx.get(n), ry.get(n)
            raw = lambda t: t.reshape(-1) if t.dtype == torch.bool else t.reshape(-1).view(torch.uint8)  # noqa: E731
            if u.shape != v.shape or u.dtype != v.dtype or not torch.equal(raw(u), raw(v)):
                ne = int((u != v).sum()) if u.shape == v.shape else -1
                rep["tensors"][n] = {"elements_differing": ne, "of": u.numel()}
    Path(a.json).write_text(json.dumps(rep, indent=1))
    print(f"{x.name} vs {y.name}: {'IDENTICAL' if not differ else 'DIFFERENT ' + str(differ[:4])}"
          + (f"; {len(rep['tensors'])} tensors differ" if rep["tensors"] else ""), flush=True)
    return 0 if not differ else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    for k, v in (("layers", 32), ("hidden", 4096), ("intermediate", 14336), ("heads", 32), ("kv-heads", 8),
                 ("vocab", 128256), ("max-positions", 8192), ("seed", 0)):
        m.add_argument(f"--{k}", type=int, default=v)
    m.add_argument("--dtype", choices=DTYPES, default="bf16")
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    v = sub.add_parser("view")
    v.add_argument("--src", required=True)
    v.add_argument("--out", required=True)
    v.add_argument("--layers", type=int, required=True)
    r = sub.add_parser("run")
    r.add_argument("--ckpt", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--json", required=True, help="prefix of the per-rank JSON files")
    r.add_argument("--recipe", default="w4a16")
    r.add_argument("--method", choices=("rtn", "gptq"), default="rtn")
    r.add_argument("--smoothquant", type=float, default=None)
    r.add_argument("--static", action="store_true")
    r.add_argument("--batches", type=int, default=8)
    r.add_argument("--batch", type=int, default=2, help="sequences per batch")
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--dtype", choices=DTYPES, default="bf16")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (CPU runs)")
    r.add_argument("--memory-trace-layer", type=int, default=None,
                   help="CUDA: record the allocator's trace over this layer and name what is alive at its peak")
    r.add_argument("--profile-layer", type=int, default=None,
                   help="torch.profiler over this layer: top operators by device and CPU time in the JSON")
    r.add_argument("--terms-on-host", action="store_true",
                   help="ranks > 0 keep their Hessian terms in host memory (lowbit.algorithms.distributed.TERMS_ON_HOST)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--json", required=True)
    a = p.parse_args(argv)
    return {"make": make, "view": view, "run": run, "compare": compare}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
