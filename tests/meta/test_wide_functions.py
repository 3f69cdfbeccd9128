"""No new public function with more than MAX_PARAMETERS parameters: a function with many settings
takes its main inputs and one typed options object (a lowbit.options.Options dataclass, e.g.
quantize_model's QuantizeOptions, gptq_model's GPTQOptions), whose fields it also accepts as keywords.

Counted: every parameter a caller can name (positional and keyword-only), not self / cls, not *args /
**kwargs. Public: the function, its class and its module have no leading underscore (__init__ counts).
The CLI (lowbit.entrypoints) and the benchmark harness (lowbit.bench) are not counted, nor Triton device
code (@triton.jit / @triton.autotune: it takes scalars, pointers and constexprs, never objects).
"""
from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MAX_PARAMETERS = 8
EXEMPT = ("entrypoints", "bench")
# The public functions over MAX_PARAMETERS today, most of them Triton launchers (which pass a kernel's
# operands on): lower it, never raise it.
MAX_WIDE = 28


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[str]:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    return names[1:] if method and names and names[0] in ("self", "cls") else names


def _triton_device_code(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated @triton.jit / @triton.autotune / @triton.heuristics (or their bare names)."""
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        name = d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""
        if name in ("jit", "autotune", "heuristics"):
            return True
    return False


def wide_functions(text: str, where: str) -> list[str]:
    """'where:line name (n parameters)' for each public function of the source `text` over the limit."""
    out = []

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (node.name.startswith("_") and node.name != "__init__") or _triton_device_code(node):
                    continue
                n = len(_parameters(node, bool(prefix)))
                if n > MAX_PARAMETERS:
                    out.append(f"{where}:{node.lineno} {prefix}{node.name} ({n} parameters)")
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(text).body, "")
    return out


def _all_wide() -> list[str]:
    out = []
    for p in sorted((SRC / "lowbit").rglob("*.py")):
        parts = p.relative_to(SRC / "lowbit").parts
        if parts[0] in EXEMPT or any(x.startswith("_") and x != "__init__.py" for x in parts):
            continue
        out += wide_functions(p.read_text(), str(p.relative_to(SRC.parent)))
    return out


def test_wide_public_functions_do_not_grow():
    wide = _all_wide()
    assert len(wide) <= MAX_WIDE, (
        f"{len(wide)} public functions take more than {MAX_PARAMETERS} parameters (at most {MAX_WIDE}):\n  "
        + "\n  ".join(wide) + "\ngive the new one a typed options object (lowbit.options.Options: see "
        "lowbit.algorithms.gptq.options.GPTQOptions) and take `options=None, **changes`")


def test_the_counter_on_planted_functions():
    """What counts and what does not: keyword-only parameters count; self, *args and **kwargs do not;
    private functions and classes are skipped; methods of public classes are seen."""
    nine = ", ".join(f"p{i}" for i in range(9))
    eight = ", ".join(f"p{i}" for i in range(8))
    text = (f"def wide({nine}): pass\n"
            f"def kw(a, *, {eight}): pass\n"
            f"def star({eight}, *args, **kwargs): pass\n"
            f"def _private({nine}): pass\n"
            f"class C:\n    def m(self, {eight}): pass\n    def n(self, {nine}): pass\n"
            f"class _D:\n    def m(self, {nine}): pass\n"
            f"@triton.jit\ndef kernel({nine}): pass\n@triton.autotune(configs=[], key=[])\n@triton.jit\ndef tuned({nine}): pass\n")
    assert wide_functions(text, "f.py") == ["f.py:1 wide (9 parameters)", "f.py:2 kw (9 parameters)",
                                            "f.py:7 C.n (9 parameters)"]
