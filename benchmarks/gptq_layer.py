"""GPTQ of Llama-3-8B-shaped decoder layers, timed per layer and extrapolated to the model's 32
layers: what `lowbit quantize --sequential --gptq --device cuda` spends per layer (the layer-by-layer
pipeline, lowbit.pipelines.layerwise, on a random-weight checkpoint that distributed_calib.py makes).

    python benchmarks/gptq_layer.py --device cuda            # 8B shapes, 128 x 2048 calibration tokens
    python benchmarks/gptq_layer.py --device cpu --hidden 128 --intermediate 256 --heads 4 --kv-heads 2 \\
        --vocab 512 --sequences 2 --seq-len 64                # the same logic at a size a CPU runs in seconds

Two layers are quantized; the second one's time is the one extrapolated (the first also pays one-time
costs: Triton compilation, the block kernel's check, allocator growth). Prints one line (seconds per
layer, x layers, GPTQ's phases); --json writes them. The default calibration is the usual GPTQ setting
(128 sequences of 2,048 tokens), on which the peers' published cost is ~30 minutes for an 8B model
on one A100.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch


def _calib_driver():
    """benchmarks/distributed_calib.py (make: the checkpoint; run: quantize_layerwise, timed)."""
    spec = importlib.util.spec_from_file_location("distributed_calib", Path(__file__).with_name("distributed_calib.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in (("hidden", 4096), ("intermediate", 14336), ("heads", 32), ("kv-heads", 8), ("vocab", 4096),
                 ("sequences", 128), ("seq-len", 2048), ("model-layers", 32)):
        p.add_argument(f"--{k}", type=int, default=v)
    p.add_argument("--recipe", default="w4a16")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads (CPU runs)")
    p.add_argument("--work", default=None, help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    drv = _calib_driver()
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        ckpt, out = Path(tmp) / "ckpt", Path(tmp) / "out"
        drv.main(["make", "--out", str(ckpt), "--layers", "2", "--hidden", str(a.hidden), "--intermediate",
                  str(a.intermediate), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--vocab", str(a.vocab),
                  "--max-positions", str(max(2048, a.seq_len)), "--device", a.device])
        drv.main(["run", "--ckpt", str(ckpt), "--out", str(out), "--json", str(Path(tmp) / "res"), "--recipe",
                  a.recipe, "--method", "gptq", "--batches", str(a.sequences), "--batch", "1", "--seq-len",
                  str(a.seq_len), "--device", a.device, "--threads", str(a.threads)])
        res = json.loads((Path(tmp) / "res.rank0.json").read_text())
    per_layer = res["seconds_per_layer"][-1]
    phases = res["phase_seconds_per_layer"][-1]
    summary = {"device": res["gpu"], "recipe": a.recipe, "shape": {k: getattr(a, k) for k in
                                                                   ("hidden", "intermediate", "heads", "kv_heads")},
               "tokens": a.sequences * a.seq_len, "seconds_per_layer": per_layer,
               "model_layers": a.model_layers, "extrapolated_seconds": per_layer * a.model_layers,
               "phases": phases, "gptq_phases_both_layers": res.get("gptq_phase_seconds", {}),
               "block_kernel": res.get("gptq_block_kernel")}
    print(f"GPTQ {a.recipe} of one {a.hidden}/{a.intermediate} layer on {res['gpu']}, {summary['tokens']} calibration "
          f"tokens: {per_layer:.1f} s per layer, x {a.model_layers} layers = {per_layer * a.model_layers / 60:.1f} min; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
