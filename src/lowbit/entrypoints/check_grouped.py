"""`lowbit check` for grouped (MoE) GEMMs: check_grouped_linear on lowbit's own grouped kernel,
or on a grouped kernel's output stored in a file.

    lowbit check --grouped w8a8-fp8 --experts 5 --tokens 37 --top-k 2 --n 96 --k 256 --routing hot
    lowbit check moe.safetensors            # metadata kind = "grouped"

--grouped RECIPE runs the recipe's grouped kernel (lowbit.ops.kernels.grouped; Triton's
interpreter without a GPU) on fresh random data, routed by RECIPE's top-k choice of --routing
("uniform", "hot": one expert in every token's top-k, "sparse": two experts get every token,
the others none, "dropped": a share of the slots dropped), in both forms an MoE runs it: the
activations gathered per token (the first GEMM) and the sorted buffer itself (the second).
A file (metadata kind=grouped) holds out [M_total, N], x [M_total, K] (the sorted token buffer,
original float values), w [E, N, K] (original float weights), offsets [E + 1] (integer: expert
e's rows are offsets[e]:offsets[e + 1]) and optionally bias [E, N]; metadata x_scheme / w_scheme
(preset, QuantScheme JSON or "none") and optionally accumulator.
Exit status 0 when every check passes, 1 when one fails, 2 on bad input.
"""
from __future__ import annotations

import os

from lowbit.entrypoints import check_file
from lowbit.entrypoints.check_file import BadCheckFile


def register(parser) -> None:
    """The grouped options of `lowbit check` (lowbit.entrypoints.check adds them)."""
    g = parser.add_argument_group("grouped (MoE) kernels")
    g.add_argument("--grouped", metavar="RECIPE", help="check lowbit's grouped kernel for RECIPE (e.g. w8a8-int8, "
                                                      "w4a16-g32, mxfp8, nvfp4) at the shapes below")
    g.add_argument("--experts", type=int, default=5, help="E, the number of experts (default 5)")
    g.add_argument("--tokens", type=int, default=37, help="T, tokens in the batch (default 37)")
    g.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    g.add_argument("--n", type=int, default=96, help="N, output features per expert (default 96)")
    g.add_argument("--k", type=int, default=256, help="K, input features (default 256)")
    from lowbit.verify.audit_grouped import ROUTINGS
    g.add_argument("--routing", choices=ROUTINGS, default="uniform", help="token distribution (default uniform)")
    g.add_argument("--seed", type=int, help="seed of the random data (default: fresh, printed)")


def check_recipe(args) -> int:
    """The --grouped self-check; prints one verdict per form and returns the exit status."""
    import torch
    if not torch.cuda.is_available():        # the Triton kernels run in the interpreter; before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from lowbit.ops.kernels.grouped import grouped_kernel
    from lowbit.ops.grouped import sort_tokens
    from lowbit.ops.grouped_run import prepare_grouped, run_grouped
    from lowbit.quantize import quantize
    from lowbit.workflows.job import parse_recipe
    from lowbit.verify.audit_grouped import random_top_k
    from lowbit.verify.grouped import check_grouped_linear

    r = parse_recipe(args.grouped)
    E, T, k, N, K = args.experts, args.tokens, args.top_k, args.n, args.k
    for name, v in (("--experts", E), ("--tokens", T), ("--top-k", k), ("--n", N), ("--k", K)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if k > E:
        raise ValueError(f"--top-k {k} > --experts {E}: a token cannot pick more distinct experts than exist")
    for side in (r.weight, r.act):   # per-group scales along K: whole groups only
        g = side.group_size if side is not None and side.strategy == "group" else None
        if g and K % g:
            down, up = K // g * g, -(-K // g) * g
            fit = f"--k {down} or {up}" if down else f"--k {up}"
            raise ValueError(f"--k {K} is not a multiple of {r.name}'s group of {g} ({side}): choose {fit}")
    kernel = grouped_kernel(r.weight, r.act)
    if kernel is None:
        raise NotImplementedError(f"recipe {r.name} has no grouped kernel (lowbit.ops.kernels.grouped)")
    kind = kernel.kind
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(T, K, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen))
    w = torch.randn(E, N, K, generator=gen) * torch.exp(torch.randn(E, N, 1, generator=gen))
    bias = torch.randn(E, N, generator=gen)
    idx = random_top_k(gen, T, E, k, args.routing)
    routing = sort_tokens(idx, E)
    qs = [quantize(w[e], r.weight) for e in range(E)]
    stacked = {f: (None if getattr(qs[0], a) is None else torch.stack([getattr(q, a) for q in qs]))
               for f, a in (("codes", "codes"), ("scale", "scale"), ("zero", "zero_point"),
                            ("scale_codes", "scale_codes"))}
    stacked["global"] = None if qs[0].global_scale is None else torch.stack([q.global_scale.reshape(()) for q in qs])
    ops = {n: t.to(dev) for n, t in prepare_grouped(kernel, r.weight, stacked, r.act).items()}
    on_dev = sort_tokens(idx.to(dev), E)
    x_sorted = x[routing.token]
    print(f"lowbit check --grouped {r.name}: kernel {kind}, E={E}, T={T}, top-k={k}, N={N}, K={K}, routing "
          f"{args.routing} (rows per expert {routing.counts().tolist()}), seed {seed}, on {dev}")
    status = 0
    for form, inp, identity in (("activations gathered per token", x, False), ("sorted buffer", x_sorted, True)):
        out = run_grouped(kernel, ops, r.weight, r.act, inp.to(dev), on_dev, bias=bias.to(dev), identity=identity)
        # the weight-only kernels and the fp4 / MX emulations accumulate in fp32
        acc = None if kind in ("int8",) else "fp32"
        v = check_grouped_linear(out.cpu(), x_sorted, w, routing.offsets, x_scheme=r.act, w_scheme=r.weight,
                                 bias=bias, accumulator=acc)
        print(f"[{form}] {v.report()}")
        status = max(status, 0 if v.passed else 1)
    return status


def grouped_tensors(path: str, t: dict) -> dict:
    """The tensors of a kind=grouped check file (lowbit.entrypoints.check_file.read), validated."""
    check_file.require(path, t, ("out", "x", "w", "offsets"), "a grouped check file needs out [M_total, N], "
                       "x [M_total, K], w [E, N, K], offsets [E + 1] (and optionally bias [E, N])")
    # any floating dtype: check_grouped_linear takes out's dtype (fp8 included) as the output rounding
    check_file.require_float(path, t, ("out", "x", "w", "bias"), floats=None)
    if t["offsets"].is_floating_point() or t["offsets"].ndim != 1:
        raise BadCheckFile(f"{path}: offsets must be a 1-D integer tensor [E + 1], got {t['offsets'].dtype} "
                           f"{list(t['offsets'].shape)}")
    return t


def run_file(path: str, t: dict, meta: dict, accumulator) -> int:
    """Check a kind=grouped file's contents (as lowbit.entrypoints.check_file.read returns them)."""
    from lowbit.verify.grouped import check_grouped_linear
    t = grouped_tensors(path, t)
    xs, ws = check_file.schemes(path, meta)
    acc = accumulator or meta.get("accumulator")
    return check_file.verdict(path, check_grouped_linear, t["out"], t["x"], t["w"], t["offsets"], x_scheme=xs,
                              w_scheme=ws, bias=t.get("bias"), accumulator=acc)
