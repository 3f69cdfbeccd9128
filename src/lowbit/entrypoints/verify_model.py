"""`lowbit verify-model DIR [--device cuda] [--samples N] [--tokens T] [--attention fp8] [--png PATH]`: check a deployed
quantized checkpoint layer by layer against lowbit's float64 reference (lowbit.pipelines.verify_model).
Exit status 0 when no layer has a logic verdict, 1 when one has, 2 when the checkpoint cannot be read."""
from __future__ import annotations

import sys
import time


def register(parser) -> None:
    parser.add_argument("directory", help="a compressed-tensors checkpoint directory (written by `lowbit quantize` "
                                          "or any tool that writes compressed-tensors)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (exact CPU twins) or cuda "
                                                       "(the prepared fast paths in bf16)")
    parser.add_argument("--samples", type=int, default=2, help="calibration sequences run (bounds the time; default 2)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--rows", type=int, default=64, help="captured rows checked per layer; attention: the last ROWS queries of every sequence (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    parser.add_argument("--attention", choices=("fp8", "int8"),
                        help="run lowbit's quantized attention (Q and P in this format) over the quantized KV cache "
                             "instead of the model's own attention implementation (default), and check it")
    parser.add_argument("--png", help="write the per-layer error over its gate as a bar chart to this PNG")


def run(args) -> int:
    from lowbit.io.st_format import CheckpointError
    from lowbit.pipelines import verify_model as vm

    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            print("lowbit verify-model: --device cuda but no CUDA device here; use --device cpu", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    try:
        rep = vm.verify_model(args.directory, samples=args.samples, tokens=args.tokens, rows=args.rows,
                              device=args.device, seed=args.seed, attention=args.attention,
                              progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"lowbit verify-model: {e}", file=sys.stderr)
        return 2
    print(rep.report())
    if args.png:
        vm.plot(rep, args.png)
        print(f"figure written to {args.png}", file=sys.stderr)
    return 1 if rep.logic else 0
