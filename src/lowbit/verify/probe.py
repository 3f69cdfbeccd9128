"""Characterize a GPU's matrix-multiply accumulator with test vectors (`lowbit probe`).

Method (after FPRev and Khattak & Mikaitis, arXiv 2512.07004): dot products whose exact sum and
the sums of candidate accumulator models differ, so each output tells the models apart. The model
family is a fused multi-term adder (accumulate.aligned_sum): each step adds `block` products and
the running sum, aligned to the largest exponent among them, every term rounded (`rounding`:
toward zero, down, or to nearest) to `bits` fraction bits below it, summed exactly; with
`promote` > 0 the running sum is added into an fp32 accumulator (round to nearest) and restarted
every `promote` K elements. Hopper's fp8 fast accumulation measured on the H200 is (13, trunc, 32, 0);
cuBLAS fp8 without fast accumulation is (13, trunc, 32, 128).

Vectors (each row a dot product of K terms, every term a product a * b of two values exact in the
input format; E = the largest exponent the format's products reach, at most 30):
- bits:    2^E + 2^(E - j) for j = 1 .. 40: exact while j <= bits (a lone power of two half an
           ulp below the kept bits is dropped by every rounding: ties go to even, 0);
- round:   +-(2^E + 0.75 * 2^(E - j)): 0.75 ulp is dropped by trunc, taken as 1 ulp by nearest; the
           negative rows tell trunc (toward zero) from floor (down);
- block:   +2^E at k = 0, -2^E at k = p, 1 everywhere else: the ones added while 2^E sits in the
           same fused sum are lost (when 2^E > 2^bits), so the output counts the ones in the steps
           after p's step, and its steps in p are the block; ones in later promote windows survive
           in the fp32 accumulator, which shows the promotion interval.
The fit runs in that order (bits, then rounding, then block and promotion), each stage keeping the
models that reproduce every output of its vectors exactly. Runs on CPU against any callable
(tests feed simulated accumulators of known parameters); `measure` runs the GPU paths.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from lowbit.verify.accumulate import ROUNDINGS, aligned_sum

BITS = range(4, 41)
BLOCKS = (1, 2, 4, 8, 16, 32, 64, 128)
PROMOTES = (0, 32, 64, 128, 256, 512)
K = 1024


@dataclass(frozen=True)
class Model:
    """A fused-adder accumulator: fraction bits kept, rounding of the aligned terms, products per
    step, promotion interval into fp32 (0: never)."""

    bits: int
    rounding: str
    block: int
    promote: int = 0


def simulate(model: Model, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products [R] of a, b [R, K] (float64, exact values) through `model`, the
    result as float32 (the path's output type) in float64."""
    return _run(model.bits, model.rounding, model.block, torch.full((a.shape[0],), model.promote), a, b)


def _run(bits: int, rounding: str, block: int, promote: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """simulate() with one promotion interval per row (0: never), so that the fit runs the
    candidates of one step width in a single pass."""
    p = a.double() * b.double()
    R, Kp = p.shape
    acc = torch.zeros(R, dtype=torch.float64)
    total = torch.zeros(R, dtype=torch.float64)
    f32 = lambda t: t.to(torch.float32).to(torch.float64)   # noqa: E731
    for s in range(0, Kp, block):
        acc = aligned_sum(torch.cat([acc[:, None], p[:, s:s + block]], dim=1), bits, rounding)
        flush = (promote > 0) & (torch.remainder(torch.full_like(promote, s + block), promote.clamp(min=1)) == 0)
        if bool(flush.any()):
            total = torch.where(flush, f32(total + acc), total)
            acc = torch.where(flush, torch.zeros_like(acc), acc)
    return f32(total + acc)


def _pow2_pair(e: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with a * b = 2^e, each a power of two with exponent in [lo, hi]."""
    ea = torch.clamp(torch.div(e + 1, 2, rounding_mode="floor"), lo, hi)
    return torch.exp2(ea.double()), torch.exp2((e - ea).double())


def block_positions(k: int) -> list[int]:
    """Where the block vectors put -2^E: every position up to twice the widest step, then every 16th."""
    return [p for p in range(1, 2 * max(BLOCKS) + 1) if p < k] + list(range(2 * max(BLOCKS) + 16, k, 16))


@dataclass
class Vectors:
    """The three vector sets: name -> (a [R, K], b [R, K]) float64, and the big exponent E."""

    sets: dict
    E: int
    block_rows: list


def vectors(emin: int, emax: int, k: int = K, E: int | None = None) -> Vectors:
    """Test vectors for an input format whose normal-or-subnormal powers of two span 2^emin ..
    2^emax (e4m3: -9 .. 8; e5m2: -16 .. 15; fp16: -24 .. 15; bf16: -133 .. 127; int8 codes 0 .. 6).
    E: the big exponent (default the largest product's, at most 30)."""
    E = min(2 * emax, 30) if E is None else E
    lo_e = 2 * emin
    sets = {}
    js = torch.tensor([j for j in range(1, 41) if E - j - 1 >= lo_e + 1])
    R = len(js)
    a, b = torch.zeros(R, k, dtype=torch.float64), torch.zeros(R, k, dtype=torch.float64)
    a[:, 0], b[:, 0] = _pow2_pair(torch.full((R,), E), emin, emax)
    a[:, 1], b[:, 1] = _pow2_pair(E - js, emin, emax)
    sets["bits"] = (a, b)
    a2, b2 = torch.zeros(2 * R, k, dtype=torch.float64), torch.zeros(2 * R, k, dtype=torch.float64)
    for sgn, rows in ((1.0, slice(0, R)), (-1.0, slice(R, 2 * R))):
        a2[rows, 0], b2[rows, 0] = _pow2_pair(torch.full((R,), E), emin, emax)
        a2[rows, 0] *= sgn
        x, y = _pow2_pair(E - js - 1, emin + 1, emax - 1)   # 1.5 * 2^emin is not exact, 1.5 * 2^(emin+1) is
        a2[rows, 1], b2[rows, 1] = sgn * 1.5 * x, y          # 0.75 * 2^(E - j), 1.5 exact in every format
    sets["round"] = (a2, b2)
    ps = block_positions(k)
    a3 = torch.ones(len(ps), k, dtype=torch.float64)
    b3 = torch.ones(len(ps), k, dtype=torch.float64)
    big_a, big_b = _pow2_pair(torch.tensor([E]), emin, emax)
    a3[:, 0], b3[:, 0] = big_a, big_b
    for i, p in enumerate(ps):
        a3[i, p], b3[i, p] = -big_a, big_b
    sets["block"] = (a3, b3)
    return Vectors(sets, E, ps)


@dataclass
class Fit:
    """What the vectors say about one path: the first consistent model and how many were."""

    fitted: bool
    bits: int | None = None
    rounding: str | None = None
    block: int | None = None
    promote: int | None = None
    candidates: int = 0
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _equal(name: str, simulated: torch.Tensor, measured: torch.Tensor) -> bool:
    return bool(torch.equal(simulated, measured.double()))


def fit(outputs: dict, vec: Vectors, agree=_equal) -> Fit:
    """The models reproducing every measured output. outputs: set name -> [R] float64; agree(name,
    simulated, measured) -> bool decides (default: exactly equal). Thousands of small steps: one
    thread is faster than a team (and 10x so on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(outputs, vec, agree)
    finally:
        torch.set_num_threads(before)


def _fit(outputs: dict, vec: Vectors, agree) -> Fit:
    same = lambda m, name: agree(name, simulate(m, *vec.sets[name]), outputs[name])  # noqa: E731
    bits = [n for n in BITS if same(Model(n, "trunc", BLOCKS[-1]), "bits")]
    if not bits:
        return Fit(False, note="no fraction-bit count reproduces the bits vectors (not a fused aligned adder, or "
                               "more than 40 bits: an exact accumulator)")
    n = bits[0]
    wide = n >= 23                # the float32 output (23 fraction bits) rounds 2^E + 2^(E - j), j > 23, itself
    rounds = [r for r in ROUNDINGS if same(Model(n, r, BLOCKS[-1]), "round")]
    if not rounds:
        return Fit(False, bits=n, note="no rounding of the aligned terms reproduces the round vectors")
    a3, b3 = vec.sets["block"]
    R = a3.shape[0]
    found = []
    for r in rounds:
        for blk in BLOCKS:
            prs = [pr for pr in PROMOTES if pr == 0 or (pr % blk == 0 and pr < a3.shape[1])]   # >= K: never
            got = _run(n, r, blk, torch.tensor(prs).repeat_interleave(R), a3.repeat(len(prs), 1),
                       b3.repeat(len(prs), 1))
            found += [Model(n, r, blk, pr) for i, pr in enumerate(prs)
                      if agree("block", got[i * R:(i + 1) * R], outputs["block"])]
    if not found:
        return Fit(False, bits=n, rounding=rounds[0], note="no step width / promotion interval reproduces the block "
                                                             "vectors (a summation tree?)")
    m = found[0]
    notes = ([f"{len(found)} models agree; the narrowest step and earliest promotion shown"] if len(found) > 1 else []) \
        + (["at least 23 fraction bits: the float32 output cannot show more"] if wide else [])
    return Fit(True, m.bits, m.rounding, m.block, m.promote, len(found), "; ".join(notes))


def probe(dot, emin: int, emax: int, k: int = K) -> Fit:
    """Fit the accumulator of `dot(a, b) -> [R]` (row-wise dot products of float64 [R, k] values
    exact in the input format; the path's float32 outputs as float64)."""
    vec = vectors(emin, emax, k)
    return fit({name: dot(*ab) for name, ab in vec.sets.items()}, vec)


# --------------------------------------------------------------------------------------- GPU paths
def _rows(fn, a: torch.Tensor, b: torch.Tensor, pad: int = 16) -> torch.Tensor:
    """Row-wise dot products through a matmul fn(A [R', K], B [R', K]) -> [R', R'] (R' padded to a
    multiple of `pad`): the diagonal."""
    R = a.shape[0]
    Rp = -(-R // pad) * pad
    A = torch.zeros(Rp, a.shape[1], dtype=torch.float64)
    B = torch.zeros(Rp, b.shape[1], dtype=torch.float64)
    A[:R], B[:R] = a, b
    out = fn(A, B).double().cpu()
    return torch.diagonal(out)[:R].clone()


def _scaled_mm(fast: bool, dtype):
    def fn(A, B):
        one = torch.ones((), device="cuda", dtype=torch.float32)
        a = A.to("cuda", torch.float32).to(dtype)
        b = B.to("cuda", torch.float32).to(dtype)
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
    return fn


def _mm_f32_out(dtype):
    def fn(A, B):
        a = A.to("cuda", torch.float32).to(dtype)
        b = B.to("cuda", torch.float32).to(dtype)
        return torch.mm(a, b.t(), out_dtype=torch.float32)
    return fn


def _triton_dot(dtype):
    from lowbit.ops.triton.probe_dot import dot_f32      # triton is optional: imported when probed
    return lambda A, B: dot_f32(A.to("cuda", torch.float32).to(dtype), B.to("cuda", torch.float32).to(dtype))


FORMAT_RANGE = {"fp8": (-9, 8), "fp16": (-24, 15), "bf16": (-60, 60)}


def paths() -> dict:
    """name -> (matmul fn(A, B) -> [R, R] float32, input format key) for the present GPU."""
    e4m3 = getattr(torch, "float8_e4m3fn", None)
    out = {}
    if e4m3 is not None:
        out["cublas_fp8_fast"] = (_scaled_mm(True, e4m3), "fp8")
        out["cublas_fp8"] = (_scaled_mm(False, e4m3), "fp8")
    out["cublas_bf16"] = (_mm_f32_out(torch.bfloat16), "bf16")
    out["cublas_fp16"] = (_mm_f32_out(torch.float16), "fp16")
    out["triton_bf16"] = (_triton_dot(torch.bfloat16), "bf16")
    if e4m3 is not None:
        out["triton_fp8"] = (_triton_dot(e4m3), "fp8")
    return out


def int8_exact() -> dict:
    """torch._int_mm: whether int8 x int8 products are summed exactly in int32 (sums past 2^24,
    where a float32 accumulator loses the last one) and what a sum past 2^31 gives."""
    k = 1088                                        # 127 * 127 * 1088 > 2^24 and < 2^31
    a = torch.full((32, k), 127, dtype=torch.int8)
    a[:, -1] = 1
    b = torch.full((32, k), 127, dtype=torch.int8)
    b[:, -1] = 1
    got = torch._int_mm(a.cuda(), b.cuda().t()).cpu()          # a [32, k] @ (b [32, k]).T
    want = 127 * 127 * (k - 1) + 1
    exact = bool((got == want).all())
    return {"fitted": exact, "exact_int32": exact, "sum": int(got[0, 0]), "expected": want}


def measure(names=None) -> dict:
    """The probe table of this machine's GPU: {"device": ..., "paths": {name: Fit dict}}."""
    if not torch.cuda.is_available():
        raise RuntimeError("lowbit probe measures a GPU's matrix units and needs CUDA; on CPU the tests run "
                           "verify.probe.fit on simulated accumulators")
    table = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "K": K, "paths": {}}
    for name, (fn, fmt) in paths().items():
        if names and name not in names:
            continue
        lo, hi = FORMAT_RANGE[fmt]
        try:
            f = probe(lambda a, b, fn=fn: _rows(fn, a, b), lo, hi)
            table["paths"][name] = f.as_dict()
        except (RuntimeError, TypeError, NotImplementedError, ImportError) as e:   # a path this torch lacks
            table["paths"][name] = Fit(False, note=f"not measured: {type(e).__name__}: {str(e).splitlines()[0]}").as_dict()
    if not names or "int8" in names:
        try:
            table["paths"]["int8"] = int8_exact()
        except RuntimeError as e:
            table["paths"]["int8"] = {"fitted": False, "note": f"not measured: {str(e).splitlines()[0]}"}
    return table


def describe(table: dict) -> str:
    """The table as text, one path a line."""
    lines = [f"lowbit probe: {table.get('device', '?')} (torch {table.get('torch', '?')}), K = {table.get('K', K)}"]
    for name, r in table["paths"].items():
        if name == "int8" and "exact_int32" in r:
            lines.append(f"  {name:18s} {'exact int32 accumulation' if r['exact_int32'] else 'NOT exact'} "
                         f"(sum {r['sum']}, expected {r['expected']})")
        elif r.get("fitted"):
            lines.append(f"  {name:18s} {r['bits']} fraction bits, {r['rounding']}, {r['block']}-term steps, "
                         f"{'promoted to fp32 every ' + str(r['promote']) + ' K' if r['promote'] else 'never promoted'}"
                         f"{' (' + r['note'] + ')' if r.get('note') else ''}")
        else:
            lines.append(f"  {name:18s} not fitted: {r.get('note', '')}")
    return "\n".join(lines)
