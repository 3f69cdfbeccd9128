"""Compile a Triton kernel for sm_90 (H100 / H200) without a GPU: Triton's own ptxas and
cuobjdump make the cubin and its SASS, so compile errors, shared memory, registers and the
shape of the machine code can be checked on a CPU-only machine (CI included). Run in a process
without TRITON_INTERPRET (the callers' tests start a subprocess)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


def fresh_process(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """`python ARGS` (["-c", script] or ["-m", module, ...]) in a new process without TRITON_INTERPRET and with this
    lowbit's source first on its path, output captured: where Triton compiles for the GPU (the tests' own process
    runs the interpreter)."""
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def compile_sm90(fn, sig: dict, consts: dict, no_div: tuple = (), **opts) -> dict:
    """Compile `fn` (a @triton.jit function) for sm_90 with signature `sig` (name -> Triton type
    string), constexprs `consts` and launch options `opts` (num_warps, num_stages, ...). Integer
    and pointer arguments are marked divisible by 16, as Triton specializes them at launch,
    except those named in `no_div`. Returns sass (static instruction count), shared (bytes),
    reg / local / stack (ptxas's figures), spill_ops (local loads / stores in the SASS) and sass_text.
    The shared memory is the compiler's figure for this compile; Triton 3.6's warp-specialized
    kernels can ask the driver for more at launch than it reports here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if n not in no_div and (t.startswith("*") or t in ("i32", "i64"))}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|LOCAL|STACK):(\d+)", res)}
    # an instruction line starts with its address; past 0xffff the address has more than four digits
    return dict(sass=sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)),
                shared=c.metadata.shared, reg=usage.get("reg"), local=usage.get("local"), stack=usage.get("stack"),
                spill_ops=spill_ops(sass), sass_text=sass)


def spill_ops(sass: str) -> int:
    """Local-memory loads and stores in the SASS: register spills. ptxas's LOCAL figure can read 0
    while the stack frame holds the spills, so the instructions are what to count."""
    return len(re.findall(r"\b(?:LDL|STL)(?:\.[A-Z0-9]+)*\s", sass))
