"""Mutation testing of lowbit.verify and of the Triton GEMMs' epilogues: each mutant loosens a
gate, a bound or a diagnosis rule, or changes an epilogue's rounding order; the tests named for
it must fail ("killed"). Survivors are listed with the reason they live.

    python scripts/mutants.py [--group verify|epilogues|all] [--out benchmarks/results/mutation.md]

--group runs one group's mutants and rewrites only that group's section of --out.

Each mutant is applied to a private copy of src/ and tests/ (the worktree is never touched) and
the tests named for it run with -x; a mutant whose tests all pass SURVIVES.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V = "src/lowbit/verify/"
GATES = ["tests/verify/test_tolerance.py", "tests/verify/test_gate_teeth.py", "tests/verify/test_check.py"]
DIAG = ["tests/verify/test_diagnose.py", "tests/verify/test_diagnose_zoo.py"]
T = "src/lowbit/ops/triton/"
EPI = ["tests/ops/test_epilogue_order.py", "tests/ops/test_gemm_triton.py"]

# (file, original text, mutated text, what the mutation means, tests that must kill it)
MUTANTS = [
    (V + "tolerance.py", '"fp32": 2.0 ** -24', '"fp32": 2.0 ** -21', "fp32 accumulator unit roundoff 8x", GATES),
    (V + "tolerance.py", "U32 = 2.0 ** -24", "U32 = 2.0 ** -21", "fp32 epilogue unit roundoff 8x", GATES),
    (V + "tolerance.py", "return 3 + (nb - 1) + int(bias), U32", "return 6 + (nb - 1) + int(bias), U32",
     "int32 epilogue rounding count doubled", GATES),
    (V + "tolerance.py", "return gc + 2 + nb + 1 + int(bias)", "return 2 * gc + 2 + nb + 1 + int(bias)",
     "float accumulator rounding count doubled", GATES),
    (V + "tolerance.py", "return math.inf if nu >= 1.0 else nu / (1.0 - nu)",
     "return math.inf if nu >= 1.0 else 2 * nu / (1.0 - nu)", "gamma_n doubled", GATES),
    (V + "tolerance.py", "kern + u_out * (ref.abs() + kern)", "kern + 2 * u_out * (ref.abs() + kern)",
     "output rounding term doubled", GATES),
    (V + "tolerance.py", "eta_out / 2 + 4 * U64 * T", "eta_out * 2 + 4 * U64 * T", "underflow term 4x", GATES),
    (V + "tolerance.py", "eta_out / 2 + 4 * U64 * T", "eta_out / 2 + 400 * U64 * T",
     "float64 reference term 100x", GATES),
    (V + "tolerance.py", "err = s / 2 + clip + div", "err = s + clip + div", "integer element bound doubled", GATES),
    (V + "tolerance.py", "err = float(fmt.unit_roundoff) * amax", "err = 2 * float(fmt.unit_roundoff) * amax",
     "float element bound doubled", GATES),
    (V + "tolerance.py", "det = gc * (Ex @ W.T", "det = 2 * gc * (Ex @ W.T", "quantization bound doubled", GATES),
    (V + "check.py", "bad = ~(err <= gate)", "bad = err > gate", "NaN outputs no longer fail", GATES),
    (V + "diagnose.py", "OVER_BUDGET = 2.0", "OVER_BUDGET = 1e9", "any evenly spread error is numerical", DIAG),
    (V + "diagnose.py", "PARTIAL = 0.8", "PARTIAL = 0.0", "every hypothesis listed as a partial match", DIAG),
    (V + "accumulate.py", "RMS_FACTOR = 4.0", "RMS_FACTOR = 1e6", "any error size fits an accumulator", DIAG),
    (V + "accumulate.py", "LINE_FACTOR = 4.0 * RMS_FACTOR", "LINE_FACTOR = 1e9",
     "no per-row / per-column check of the accumulator claim", DIAG),
    (V + "accumulate.py", "FIT_SLACK = 0.5", "FIT_SLACK = 1e9",
     "accumulator claim ignores an error proportional to the output per line", DIAG),
    (V + "accumulate.py", "lines_ok &= bool((mine >= per.amin(dim=0) / LINE_FACTOR).all())", "pass",
     "accumulator claim allows rows / columns without error", DIAG),
    (V + "accumulate.py", "FAST_ACC_BITS = 13", "FAST_ACC_BITS = 10", "fp8 fast accumulator 3 bits narrower", DIAG),
    (V + "accumulate.py", "return (torch.trunc(terms / q) * q).sum(dim=-1)",
     "return torch.trunc(terms.sum(dim=-1) / q[..., 0]) * q[..., 0]",
     "fp8 step truncates only its sum (the pre-H200 model)", DIAG),
    (V + "diagnose.py", 'if acc_name == "fp8_fast" and _accumulator_sized(confirmed):',
     'if False:', "fitted scale bugs named before the fp8 accumulator", DIAG),
    (V + "simulate.py", "return worst <= 1.0, share, worst", "return worst <= 10.0, share, worst",
     "a hypothesis confirmed at 10x the gate", DIAG),
    (V + "bugs_output.py", 'yield Hyp("k_tail_dropped", f"{what} never accumulated", ref - C,',
     'yield Hyp("k_tail_dropped", f"{what} never accumulated", ref - 0.5 * C,', "K tail simulated wrongly", DIAG),
    (V + "bugs_scales.py", "_rescale(qt, s[:1].expand_as(s))", "_rescale(qt, s[-1:].expand_as(s))",
     "stride-0 hypothesis reads the last row", DIAG),
]

# The epilogues' documented rounding orders (module docstrings of gemm_int8, gemm_fp8,
# gemm_blockscaled, w8a16; common.rowcol_scale / add_bias / cast_out).
EPILOGUE_MUTANTS = [
    (T + "common.py", "return (accf * sa[:, None]) * sb[None, :]", "return accf * (sa[:, None] * sb[None, :])",
     "int8/fp8 epilogue: sa * sb multiplied first", EPI),
    (T + "common.py", "return (accf * sa[:, None]) * sb[None, :]", "return (accf * sb[None, :]) * sa[:, None]",
     "int8/fp8 epilogue: weight scale applied first", EPI),
    (T + "gemm_int8.py", "accf = (acc.to(tl.int64) - za[:, None] * cs[None, :]).to(tl.float32)",
     "accf = acc.to(tl.float32) - (za[:, None] * cs[None, :]).to(tl.float32)",
     "int8 zero-point correction in fp32 instead of int64", EPI),
    (T + "common.py", "y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]\n    return y",
     "y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.bfloat16).to(tl.float32)[None, :]\n"
     "    return y", "int8 epilogue: bias rounded to bf16 before the add", EPI),
    (T + "common.py", "y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]\n    c_ptrs",
     "y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.bfloat16).to(tl.float32)[None, :]\n"
     "    c_ptrs", "fp8/block-scaled/W8A16 epilogue: bias rounded to bf16 before the add", EPI),
    (T + "common.py", "bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536", "bits = bits & -65536",
     "bf16 output truncated instead of rounded to nearest even", EPI),
    (T + "common.py", "bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536", "bits = (bits + 0x8000) & -65536",
     "bf16 output ties rounded away from zero", EPI),
    (T + "gemm_blockscaled.py", "acc += part * (sa[:, None] * sb[None, :])",
     "acc += (part * sa[:, None]) * sb[None, :]", "block-scaled: partial times sa, then sb (per-row weight scales)",
     EPI),
    (T + "gemm_blockscaled.py", "acc += part * (sa * sb)[:, None]", "acc += (part * sa[:, None]) * sb",
     "block-scaled: partial times sa, then sb (one weight scale per tile)", EPI),
    (T + "w8a16.py", "bias_store_tile(acc * sb[None, :],",
     "bias_store_tile(acc * sb.to(tl.bfloat16).to(tl.float32)[None, :],",
     "W8A16 scale rounded to bf16", EPI),
]
GROUPS = {"verify": MUTANTS, "epilogues": EPILOGUE_MUTANTS}
TITLES = {"verify": "lowbit.verify (gates, bounds, diagnosis rules)",
          "epilogues": "the Triton GEMMs' epilogues (rounding order; interpreter on the CPU)"}

# Survivors that cannot be killed, and why.
EQUIVALENT = {
    "float64 reference term 100x": "4 * 2^-53 * T is below 1e-7 of every other term of every gate lowbit can "
                                   "state (the smallest is the int32 epilogue's 3 * 2^-24 * T); 100x changes no "
                                   "verdict of any kernel, so no test can tell",
}


def run_one(tmp: str, tests: list[str]) -> tuple[bool, float]:
    t0 = time.time()
    env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "src"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        *tests], cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
    return r.returncode != 0, time.time() - t0


def run_group(mutants, log) -> list[tuple[str, str, bool, float]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in ("src", "tests"):
            shutil.copytree(os.path.join(ROOT, d), os.path.join(tmp, d))
        for path, old, new, what, tests in mutants:
            f = os.path.join(tmp, path)
            text = open(f).read()
            if text.count(old) != 1:
                raise SystemExit(f"mutant {what!r}: {old!r} occurs {text.count(old)} times in {path}")
            open(f, "w").write(text.replace(old, new))
            try:
                killed, secs = run_one(tmp, tests)
            finally:
                open(f, "w").write(text)
            rows.append((path, what, killed, secs))
            log(f"{'killed ' if killed else 'SURVIVED'} {secs:6.1f}s  {path}: {what}")
    return rows


def section(group: str, rows) -> str:
    out = [f"## {TITLES[group]}\n\n`python scripts/mutants.py --group {group}`\n\n"
           "| file | mutation | result | seconds |\n|---|---|---|---|\n"]
    for path, what, killed, secs in rows:
        out.append(f"| {path.replace('src/lowbit/', '')} | {what} | {'killed' if killed else '**survived**'} "
                   f"| {secs:.0f} |\n")
    live = [what for _, what, killed, _ in rows if not killed]
    out.append(f"\n{len(rows) - len(live)} of {len(rows)} killed.\n")
    for what in live:
        out.append(f"\n- survivor '{what}': {EQUIVALENT.get(what, 'NOT explained: add a test that kills it')}\n")
    return "".join(out) + "\n"


HEADER = ("# Mutation testing\n\nGenerated by `python scripts/mutants.py`: each mutant loosens a gate or a "
          "diagnosis rule, or changes a kernel epilogue's rounding, in a private copy of src/; the tests named "
          "for it must fail on it.\n\n")


def kept_sections(text: str) -> dict[str, str]:
    """The groups' sections of an existing report, each up to the next section."""
    out = {}
    for g in GROUPS:
        head = f"## {TITLES[g]}"
        if head in text:
            rest = text[text.index(head):]
            end = rest.find("\n## ", 1)
            out[g] = rest if end < 0 else rest[:end + 1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", choices=[*GROUPS, "all"], default="all")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "mutation.md"))
    args = ap.parse_args()
    groups = list(GROUPS) if args.group == "all" else [args.group]
    old = open(args.out).read() if os.path.exists(args.out) else ""
    sections = kept_sections(old)
    for g in groups:
        sections[g] = section(g, run_group(GROUPS[g], lambda s: print(s, flush=True)))
    with open(args.out, "w") as fh:
        fh.write(HEADER + "".join(sections[g] for g in GROUPS if g in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
