"""`lowbit audit` rows for grouped (MoE) GEMMs: every grouped kernel found on this machine,
checked by check_grouped_linear over routings that stress a grouped kernel's bookkeeping.

Kernels (each gets the float activations [T, K], the float expert weights [E, N, K], the top-k
expert ids [T, k] and a bias [E, N]; it returns the sorted rows [M_total, N] in
lowbit.ops.grouped.sort_tokens' order, checked against the float64 grouped reference):
- lowbit's grouped kernels, one per class of lowbit.ops.kernels.grouped (lowbit.ops.grouped_run:
  the activations quantized per token and gathered, the weights per expert);
- torch's: torch._grouped_mm (bf16 operands, the unquantized baseline) and
  torch._scaled_grouped_mm (fp8 e4m3 row-wise: per-token x per-expert-channel scales), where the
  installed torch has them; where it has them but not for this device they are n/a with torch's
  reason (torch 2.13's CPU build has _grouped_mm, not _scaled_grouped_mm). Their operands are
  padded as a caller must (K, N to multiples of 16, each expert's rows to a multiple of 16: zero
  rows and columns, exact) and the padding is sliced off before the check.
Cases: uniform routing at an odd expert count, one hot expert, empty experts, dropped slots,
decode (T = 1), K not a multiple of any tile.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

import lowbit as lb
from lowbit.ops.grouped import sort_tokens
from lowbit.ops.grouped_run import prepare_grouped, run_grouped
from lowbit.ops.kernels.grouped import grouped_kernel
from lowbit.quantize import quantize
from lowbit.verify.audit import Cell, _group, audit_grid, k_for, refused_cell, verdict_cell
from lowbit.verify.grouped import check_grouped_linear

ROUTINGS = ("uniform", "hot", "sparse", "dropped")


@dataclass
class GroupedCase:
    name: str
    T: int
    E: int
    top_k: int
    N: int
    routing: str
    k_kind: str = "base"


CASES = [GroupedCase("MoE uniform, E=5", 13, 5, 2, 24, "uniform"),
         GroupedCase("MoE one hot expert", 13, 3, 2, 24, "hot"),
         GroupedCase("MoE empty experts", 12, 7, 2, 24, "sparse"),
         GroupedCase("MoE dropped slots", 11, 5, 2, 24, "dropped"),
         GroupedCase("MoE decode T=1", 1, 5, 2, 24, "uniform"),
         GroupedCase("MoE K not a tile multiple", 9, 3, 2, 20, "uniform", k_kind="odd")]


@dataclass
class GroupedSpec:
    """fn(x [T, K], w [E, N, K], top_k_index [T, k], bias [E, N]) -> out [M_total, N], all on the
    audit's device; schemes None = unquantized side; dtype: the kernel reads x and w in it."""
    name: str
    x_scheme: object
    w_scheme: object
    fn: Callable
    accumulator: str | None = None
    note: str = ""
    dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None   # the output's rounding when fn returns it widened to fp32
    takes_bias: bool = True                # False: fn gets bias None (a bias added after a bf16 output
                                           # rounding is not the arithmetic the reference models)


def random_top_k(gen: torch.Generator, T: int, E: int, k: int, kind: str) -> torch.Tensor:
    """Top-k expert ids [T, k], distinct per token: "uniform"; "hot" (one expert in every token's
    top-k); "sparse" (two experts get every token, the others none; slots past two dropped);
    "dropped" (40% of the slots after the first = E, the dropped-slot marker)."""
    if kind not in ROUTINGS:
        raise ValueError(f"routing {kind!r}; choose one of {ROUTINGS}")
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    if kind == "hot":
        hot = int(torch.randint(0, E, (1,), generator=gen))
        for t in range(T):
            row = [e for e in idx[t].tolist() if e != hot]
            idx[t] = torch.tensor([hot] + row[:k - 1])
    elif kind == "sparse":
        pair = torch.randperm(E, generator=gen)[:2]
        idx[:, 0] = pair[torch.arange(T) % 2]
        if k > 1:
            idx[:, 1] = pair[(torch.arange(T) + 1) % 2]
            idx[:, 2:] = E
    elif kind == "dropped" and k > 1:      # every token keeps its first slot
        drop = torch.rand(T, k, generator=gen) < 0.4
        drop[:, 0] = False
        idx[drop] = E
    return idx


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------
def _lowbit(x_scheme, w_scheme):
    def fn(x, w, idx, bias):
        kernel = grouped_kernel(w_scheme, x_scheme)
        E = w.shape[0]
        qs = [quantize(w[e], w_scheme) for e in range(E)]
        pick = lambda a: None if getattr(qs[0], a) is None else torch.stack([getattr(q, a) for q in qs])  # noqa: E731
        stacked = {"codes": pick("codes"), "scale": pick("scale"), "zero": pick("zero_point"),
                   "scale_codes": pick("scale_codes"),
                   "global": None if qs[0].global_scale is None else torch.stack([q.global_scale.reshape(())
                                                                                  for q in qs])}
        ops = prepare_grouped(kernel, w_scheme, stacked, x_scheme)
        return run_grouped(kernel, ops, w_scheme, x_scheme, x, sort_tokens(idx, E), bias=bias)
    return fn


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _padded_groups(rows_a: torch.Tensor, offsets: torch.Tensor, Kp: int, fill=0):
    """The sorted rows [M, K] laid out with every expert's rows padded to a multiple of 16 (zero rows)
    and K to Kp: (a [Mp, Kp], offs int32 [E] cumulative ends, index of each real row in a)."""
    counts = (offsets[1:] - offsets[:-1]).tolist()
    ends, where, start = [], [], 0
    for e, c in enumerate(counts):
        where += list(range(start, start + c))
        start += _up(c, 16)
        ends.append(start)
    a = torch.full((max(start, 16), Kp), fill, dtype=rows_a.dtype, device=rows_a.device)
    where_t = torch.tensor(where, dtype=torch.int64, device=rows_a.device)
    a[where_t, : rows_a.shape[1]] = rows_a
    return a, torch.tensor(ends, dtype=torch.int32, device=rows_a.device), where_t


def _torch_grouped_mm(x, w, idx, bias):
    """torch._grouped_mm in bf16 (the unquantized grouped baseline), bf16 out."""
    E, N, K = w.shape
    r = sort_tokens(idx, E)
    Kp, Np = _up(K, 16), _up(N, 16)
    a, offs, where = _padded_groups(x[r.token].to(torch.bfloat16), r.offsets, Kp)
    b = torch.zeros(E, Np, Kp, dtype=torch.bfloat16, device=w.device)
    b[:, :N, :K] = w.to(torch.bfloat16)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)[where, :N].float()


def _torch_scaled_grouped_mm(x_scheme, w_scheme):
    def fn(x, w, idx, bias):
        """torch._scaled_grouped_mm, fp8 row-wise (scale_a per row, scale_b per expert and column), bf16 out."""
        E, N, K = w.shape
        r = sort_tokens(idx, E)
        xq = quantize(x[r.token], x_scheme)
        wq = [quantize(w[e], w_scheme) for e in range(E)]
        Kp, Np = _up(K, 16), _up(N, 16)
        a, offs, where = _padded_groups(xq.codes.view(torch.uint8), r.offsets, Kp)
        sa = torch.ones(a.shape[0], dtype=torch.float32, device=x.device)
        sa[where] = xq.scale.reshape(-1).float()
        b = torch.zeros(E, Np, Kp, dtype=torch.uint8, device=w.device)
        sb = torch.ones(E, Np, dtype=torch.float32, device=w.device)
        for e, q in enumerate(wq):
            b[e, :N, :K] = q.codes.view(torch.uint8)
            sb[e, :N] = q.scale.reshape(-1).float()
        out = torch._scaled_grouped_mm(a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn).transpose(-2, -1),
                                       sa, sb, offs=offs, out_dtype=torch.bfloat16)
        return out[where, :N].float()
    return fn


def discover(device: str, triton_ok: bool) -> list[GroupedSpec]:
    """Every grouped kernel this machine can run: lowbit's (with Triton), torch's (when present)."""
    P = lb.get_preset
    specs = []
    if triton_ok:
        pairs = [("int8", P("int8_token"), P("int8_channel"), None),
                 ("fp8 rowwise", P("fp8_row"), P("fp8_row"), "fp32"),
                 ("w8a16 int8", None, P("int8_channel"), "fp32"), ("w4a16 int4_g128", None, P("int4_g128"), "fp32"),
                 ("w4a16 int4_g128_asym", None, P("int4_g128_asym"), "fp32"), ("w4a16 mxfp4", None, P("mxfp4"), "fp32"),
                 ("w4a16 nvfp4", None, P("nvfp4"), "fp32"), ("mxfp8", P("mxfp8"), P("mxfp8"), "fp32"),
                 ("mxfp4 x mxfp4", P("mxfp4"), P("mxfp4"), "fp32"), ("nvfp4 x nvfp4", P("nvfp4"), P("nvfp4"), "fp32")]
        specs += [GroupedSpec(f"lowbit grouped {n}", xs, ws, _lowbit(xs, ws), acc) for n, xs, ws, acc in pairs]
    if hasattr(torch, "_grouped_mm"):
        specs.append(GroupedSpec("torch._grouped_mm (bf16)", None, None, _torch_grouped_mm, "fp32",
                                 note="bf16 operands (the check sees the same bf16 values), bf16 out",
                                 dtype=torch.bfloat16, out_dtype=torch.bfloat16, takes_bias=False))
    if hasattr(torch, "_scaled_grouped_mm"):
        fr = P("fp8_row")
        specs.append(GroupedSpec("torch._scaled_grouped_mm rowwise fp8", fr, fr, _torch_scaled_grouped_mm(fr, fr),
                                 "fp32", note="per-token x per-expert-channel fp32 scales, bf16 out",
                                 out_dtype=torch.bfloat16, takes_bias=False))
    return specs


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
def run_cell(spec: GroupedSpec, case: GroupedCase, device: str, seed: int) -> Cell:
    gen = torch.Generator().manual_seed(seed)
    K = k_for(math.lcm(_group(spec.x_scheme), _group(spec.w_scheme)), case.k_kind)
    x = torch.randn(case.T, K, generator=gen) * torch.exp(torch.randn(case.T, 1, generator=gen))
    w = torch.randn(case.E, case.N, K, generator=gen) * torch.exp(torch.rand(case.E, case.N, 1, generator=gen) * 3)
    if spec.dtype is not None:          # what the kernel reads is what the check sees
        x, w = x.to(spec.dtype).float(), w.to(spec.dtype).float()
    bias = torch.randn(case.E, case.N, generator=gen) if spec.takes_bias else None
    idx = random_top_k(gen, case.T, case.E, case.top_k, case.routing)
    routing = sort_tokens(idx, case.E)
    t0 = time.perf_counter()
    try:
        out = spec.fn(x.to(device), w.to(device), idx.to(device), None if bias is None else bias.to(device))
    except Exception as e:      # a refusal (n/a) or a crash (error): audit.refused_cell
        return refused_cell(spec.name, case.name, e, t0)
    v = check_grouped_linear(out.detach().cpu(), x[routing.token], w, routing.offsets, x_scheme=spec.x_scheme,
                             w_scheme=spec.w_scheme, bias=bias, accumulator=spec.accumulator,
                             out_dtype=spec.out_dtype)
    return verdict_cell(spec.name, case.name, v, t0)


def audit(specs: list[GroupedSpec], cases: list[GroupedCase] = CASES, *, device: str = "cpu", seed: int = 0,
          progress: Callable[[str], None] | None = None) -> list[Cell]:
    """Every grouped kernel on every case (row-major: kernel, then case)."""
    return audit_grid(run_cell, specs, cases, device, seed, progress, tag="grouped ")
