"""The package's import graph: no circles, and every import points down the layers of
docs/architecture.md. Both are read from the source (every import statement, module level or
inside a function), so an import hidden in a function to dodge a circle is still seen.

A package face (`__getattr__` in an `__init__.py`, resolving public names lazily) is exempt:
it is how `lowbit.nn.quantize_model` keeps working although the function lives in a higher layer.
"""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# Layers, low to high: a module may import its own layer and the ones before it.
LAYERS = [
    {"lowbit", "lowbit.formats", "lowbit.scheme", "lowbit.quantize", "lowbit.packing", "lowbit.sparsity",
     "lowbit.profiling", "lowbit.io", "lowbit.progress"},
    {"lowbit.ops"},
    {"lowbit.verify"},
    {"lowbit.nn"},
    {"lowbit.recipes"},
    {"lowbit.archs"},
    {"lowbit.algorithms"},
    {"lowbit.pipelines"},
    {"lowbit.diagnosis", "lowbit.evaluation"},
    {"lowbit.experiments", "lowbit.bench", "lowbit.testing", "lowbit.entrypoints", "lowbit.workflows",
     "lowbit.__main__"},
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "lowbit").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _layer(mod: str) -> int:
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        for i, group in enumerate(LAYERS):
            if prefix in group and (n > 1 or mod == "lowbit"):
                return i
    raise AssertionError(f"module {mod} is in no layer: add its package to LAYERS")


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        faces = {id(n) for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                 and path.name == "__init__.py" for n in ast.walk(f)}
        is_pkg = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(tree):
            if id(node) in faces:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                names = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in mods else parent for a in node.names]
            else:
                continue
            for n in names:
                if not n.startswith("lowbit"):
                    continue
                while n not in mods:
                    n = n.rsplit(".", 1)[0]
                if n != mod:
                    deps.add(n)
        edges[mod] = deps
    return edges


MODS = _modules()
EDGES = _imports(MODS)


def test_no_import_circles():
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("mod", sorted(MODS))
def test_imports_point_down_the_layers(mod):
    up = sorted(d for d in EDGES[mod] if _layer(d) > _layer(mod))
    assert not up, f"{mod} (layer {_layer(mod)}) imports higher layers: {[(d, _layer(d)) for d in up]}"


def _local_imports() -> dict[str, int]:
    """Per module outside the CLI: the import statements of lowbit modules inside function bodies
    (the package faces' __getattr__ excepted)."""
    out = {}
    for mod, path in MODS.items():
        if mod.startswith("lowbit.entrypoints"):
            continue
        tree = ast.parse(path.read_text())
        seen = set()
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                    (f.name == "__getattr__" and path.name == "__init__.py"):
                continue
            for node in ast.walk(f):
                if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowbit")
                        or isinstance(node, ast.Import) and any(a.name.startswith("lowbit") for a in node.names)):
                    seen.add(id(node))
        if seen:
            out[mod] = len(seen)
    return out


# Function-local imports of lowbit modules outside the CLI (which loads a command's modules only when
# that command runs): each is a cost to a reader (the module's dependencies are not where they are
# listed), kept only where an optional dependency or a real cycle needs one. The bound is the count
# today; lower it when some move to module level, never raise it.
MAX_LOCAL_IMPORTS = 244


def test_function_local_imports_do_not_grow():
    n = sum(_local_imports().values())
    assert n <= MAX_LOCAL_IMPORTS, (f"{n} function-local lowbit imports outside lowbit.entrypoints (at most "
                                    f"{MAX_LOCAL_IMPORTS}): import at module level unless an optional dependency "
                                    "or a cycle needs it, and say which in a comment")


def test_nn_holds_only_runtime_modules():
    runtime = {"lowbit.nn", "lowbit.nn.quant_linear", "lowbit.nn.shared_input", "lowbit.nn.experts",
               "lowbit.nn.kv_cache"}
    extra = sorted(m for m in MODS if m.startswith("lowbit.nn.") and m not in runtime)
    assert not extra, f"lowbit.nn is for runtime modules; move {extra} to their layer"


def test_the_checker_sees_a_planted_circle():
    """The checker itself: a two-module circle hidden in a function is found."""
    saved = dict(EDGES)
    try:
        EDGES["lowbit.scheme"] = EDGES["lowbit.scheme"] | {"lowbit.formats"}
        EDGES["lowbit.formats"] = EDGES["lowbit.formats"] | {"lowbit.scheme"}
        with pytest.raises(AssertionError, match="import circles"):
            test_no_import_circles()
    finally:
        EDGES.clear()
        EDGES.update(saved)
