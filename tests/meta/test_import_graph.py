"""The package's import graph: no circles, every import points down the layers of
docs/architecture.md, and no import hidden in a function without a reason. All are read from the
source (every import statement, module level or inside a function), so an import hidden in a function
to dodge a circle is still seen.

A package face (`__getattr__` in an `__init__.py`, resolving the public names of its `_EXPORTS` lazily)
is exempt: it is how `lowbit.nn.quantize_model` keeps working although the function lives in a higher
layer. A name a face resolves counts as an import of the module that defines it.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys
from dataclasses import dataclass

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# Layers, low to high: a module may import its own layer and the ones before it.
LAYERS = [
    {"lowbit", "lowbit.formats", "lowbit.scheme", "lowbit.quantize", "lowbit.packing", "lowbit.sparsity",
     "lowbit.profiling", "lowbit.io", "lowbit.progress", "lowbit.options"},
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


def _required() -> set[str]:
    """The import names of the dependencies every install has (pyproject's `dependencies`); any other
    package outside the standard library is optional."""
    text = (SRC.parent / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S).group(1)
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).replace("-", "_") for d in re.findall(r'"([^"]+)"', deps)}


@dataclass(frozen=True)
class Import:
    """One import statement."""
    mod: str                    # the module it is in
    path: str                   # that module's file, for messages
    line: int
    targets: frozenset[str]     # the lowbit modules it names (a face's name: the module that defines it)
    external: frozenset[str]    # the top-level names of the other packages it names
    where: str                  # "module" (runs on import), "function" (runs when called),
                                # "typing" (under `if TYPE_CHECKING:`, never runs), "face" (a face's __getattr__)
    comment: str                # the comments on its lines


def _ancestors(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or
                                         isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _face_exports(tree: ast.Module) -> dict[str, str]:
    """A face's public names -> the modules defining them (its `_EXPORTS` literal), or {} if no face."""
    if not any(isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for f in tree.body):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]:
            return ast.literal_eval(node.value)
    return {}


class Graph:
    """Every import statement of a source tree {module name: (source, is a package)}, and what importing
    a module runs."""

    def __init__(self, sources: dict[str, tuple[str, bool]], paths: dict[str, str] | None = None,
                 parsed: Graph | None = None):
        """`parsed`: a graph of the same tree but for added modules, whose statements to reuse (parsing
        is the slow part)."""
        self.sources = sources
        self.paths = paths or {m: m for m in sources}
        self.required = _required()
        old = {m: parsed.sources[m] for m in parsed.sources} if parsed else {}
        trees = {m: ast.parse(text) for m, (text, _) in sources.items() if old.get(m) != sources[m]}
        self.faces = {**(parsed.faces if parsed else {}),
                      **{m: _face_exports(t) for m, t in trees.items() if sources[m][1]}}
        self.statements = [s for s in (parsed.statements if parsed else []) if s.mod not in trees]
        self.statements += [s for m, t in trees.items() for s in self._statements(m, t)]
        self.on_import: dict[str, list[Import]] = {m: [] for m in sources}
        for s in self.statements:
            if s.where == "module":
                self.on_import[s.mod].append(s)
        self._loads: dict[tuple[str, frozenset[str]], tuple[set[str], set[str]]] = {}

    def _module(self, name: str) -> str | None:
        """The longest lowbit module `name` lies in (a.b.func -> a.b), None outside lowbit."""
        while name not in self.sources:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    def _resolve(self, mod: str, node: ast.Import | ast.ImportFrom) -> tuple[set[str], set[str]]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if self.sources[mod][1] else mod.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            face = self.faces.get(base, {})
            names = [face[a.name] if a.name in face else f"{base}.{a.name}" for a in node.names]
        targets, external = set(), set()
        for n in names:
            inside = self._module(n)
            if inside is not None:
                targets.add(inside)
            elif n.split(".")[0] not in sys.stdlib_module_names and n != "__future__":
                external.add(n.split(".")[0])
        return targets, external

    def _statements(self, mod: str, tree: ast.Module) -> list[Import]:
        lines = self.sources[mod][0].splitlines()
        where: dict[int, str] = {}

        def mark(node: ast.AST, kind: str) -> None:
            for n in ast.walk(node):
                where.setdefault(id(n), kind)

        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                face = node.name == "__getattr__" and node in tree.body and self.sources[mod][1]
                mark(node, "face" if face else "function")
            elif _is_type_checking(node):
                for child in node.body:
                    mark(child, "typing")
        out = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets, external = self._resolve(mod, node)
                # an import statement holds no string, so a '#' on its lines starts a comment
                text = " ".join("#" + lines[i - 1].partition("#")[2] for i in range(node.lineno, node.end_lineno + 1)
                                if "#" in lines[i - 1])
                out.append(Import(mod, self.paths[mod], node.lineno, frozenset(targets - {mod}),
                                  frozenset(external), where.get(id(node), "module"), text))
        return out

    def loads(self, mod: str, running: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
        """(lowbit modules, other packages) that importing `mod` runs, when the packages in `running` are
        already being imported: Python imports a module's parent packages first, so they are not run
        again (but an import that names one explicitly gets it half-built, so that counts)."""
        key = (mod, running)
        if key not in self._loads:
            seen, external = set(), set()
            stack = [mod] + [a for a in _ancestors(mod) if a not in running]
            while stack:
                m = stack.pop()
                if m in seen:
                    continue
                seen.add(m)
                for s in self.on_import[m]:
                    external |= s.external
                    for t in s.targets:
                        stack += [t] + [a for a in _ancestors(t) if a not in running]
            self._loads[key] = (seen, external)
        return self._loads[key]

    def reasons(self, s: Import) -> list[str]:
        """Why a function-local import cannot move to module level; [] if it can."""
        out = ["lazy"] if "lazy:" in s.comment else []
        has = self.loads(s.mod)[1]
        for t in sorted(s.targets):
            mods, external = self.loads(t, frozenset(_ancestors(s.mod)))
            if s.mod in mods:
                out.append(f"cycle: {t} imports {s.mod}")
            optional = {p for p in external - has if p not in self.required}
            out += [f"optional: {p}" for p in sorted(optional)]
        return out

    def local_imports(self) -> list[Import]:
        """The function-local imports of lowbit modules outside the CLI (which loads a command's
        modules only when that command runs)."""
        return [s for s in self.statements if s.where == "function" and s.targets
                and not s.mod.startswith("lowbit.entrypoints")]

    def unjustified(self) -> list[Import]:
        return [s for s in self.local_imports() if not self.reasons(s)]


def _sources() -> tuple[dict[str, tuple[str, bool]], dict[str, str]]:
    sources, paths = {}, {}
    for p in sorted((SRC / "lowbit").rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        sources[name] = (p.read_text(), p.name == "__init__.py")
        paths[name] = str(p.relative_to(SRC.parent))
    return sources, paths


GRAPH = Graph(*_sources())
MODS = GRAPH.sources
EDGES = {m: set() for m in MODS}
for _s in GRAPH.statements:
    if _s.where != "face":
        EDGES[_s.mod] |= _s.targets


def _layer(mod: str) -> int:
    parts = mod.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        for i, group in enumerate(LAYERS):
            if prefix in group and (n > 1 or mod == "lowbit"):
                return i
    raise AssertionError(f"module {mod} is in no layer: add its package to LAYERS")


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


# Function-local imports of lowbit modules outside the CLI: each is a cost to a reader (the module's
# dependencies are not where they are listed), kept only where
#   - a cycle needs one: the imported module, through its own module-level imports, imports this one;
#   - an optional dependency needs one: importing it would load a package outside pyproject's
#     `dependencies` (triton, transformers, ...) that this module does not load already;
#   - startup needs one: marked `# lazy: <why>` (a module `import lowbit` loads, a slow target).
# These packages hold none without a reason, and each says its reason in a trailing comment:
CLEANED = ("lowbit.bench", "lowbit.ops", "lowbit.io", "lowbit.nn", "lowbit.archs", "lowbit.recipes",
           "lowbit.experiments", "lowbit.profiling", "lowbit.formats", "lowbit.verify", "lowbit.algorithms",
           "lowbit.diagnosis", "lowbit.evaluation", "lowbit.quantize", "lowbit.scheme",
           "lowbit.pipelines")
# Elsewhere, the count of those without a reason today; lower it as they move, never raise it.
MAX_UNJUSTIFIED_ELSEWHERE = 0
# All function-local lowbit imports outside the CLI, justified or not: lower it, never raise it.
MAX_LOCAL_IMPORTS = 59

_FIX = ("import it at module level; if that would close a cycle, or load an optional dependency, or slow "
        "`import lowbit`, keep it local with a trailing comment saying which (`# cycle: ...`, "
        "`# optional: triton`, `# lazy: <why>`)")


def _cleaned(mod: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in CLEANED)


def _unjustified_in_cleaned(graph: Graph) -> list[Import]:
    return [s for s in graph.unjustified() if _cleaned(s.mod)]


def _says_why(s: Import, reasons: list[str]) -> bool:
    """The comment names a reason: the word "cycle", the optional package, or the lazy marker."""
    return any(("cycle" if r.startswith("cycle") else r.split(": ")[-1]) in s.comment for r in reasons)


def _reason_unsaid(graph: Graph) -> list[Import]:
    """The justified local imports in CLEANED whose comment does not say why."""
    return [s for s in graph.local_imports() if _cleaned(s.mod) and graph.reasons(s)
            and not _says_why(s, graph.reasons(s))]


def _listing(graph: Graph, found: list[Import]) -> str:
    return "\n".join(f"  {s.path}:{s.line} imports {', '.join(sorted(s.targets))} {graph.reasons(s) or ''}"
                     for s in found)


def test_no_function_local_import_without_a_reason():
    bad = _unjustified_in_cleaned(GRAPH)
    assert not bad, f"function-local imports without a reason:\n{_listing(GRAPH, bad)}\n{_FIX}"


def test_function_local_imports_say_why():
    unsaid = _reason_unsaid(GRAPH)
    assert not unsaid, f"function-local imports whose comment does not say why:\n{_listing(GRAPH, unsaid)}\n{_FIX}"


def test_function_local_imports_without_a_reason_elsewhere_do_not_grow():
    bad = [s for s in GRAPH.unjustified() if not _cleaned(s.mod)]
    assert len(bad) <= MAX_UNJUSTIFIED_ELSEWHERE, (
        f"{len(bad)} function-local imports without a reason outside {CLEANED} (at most "
        f"{MAX_UNJUSTIFIED_ELSEWHERE}):\n{_listing(GRAPH, bad)}\n{_FIX}")


def test_function_local_imports_do_not_grow():
    n = len(GRAPH.local_imports())
    assert n <= MAX_LOCAL_IMPORTS, (f"{n} function-local lowbit imports outside lowbit.entrypoints (at most "
                                    f"{MAX_LOCAL_IMPORTS}): {_FIX}")


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


def _planted(extra: dict[str, str]) -> Graph:
    """The real tree with the modules `extra` added (lowbit.formats.planted_*: in a cleaned package)."""
    sources = {**GRAPH.sources, **{m: (text, False) for m, text in extra.items()}}
    return Graph(sources, {**GRAPH.paths, **{m: m.replace(".", "/") + ".py" for m in extra}}, parsed=GRAPH)


def test_the_checker_sees_a_planted_local_import():
    """A plain repeat inside a function is caught at its file:line; the same kind of import where the
    target imports the module back (a cycle) is not, nor one marked lazy; a reason must be said."""
    repeat = "import torch\n\n\ndef f():\n    from lowbit.scheme import QuantScheme\n    return QuantScheme\n"
    lazy = repeat.replace("QuantScheme\n", "QuantScheme  # lazy: a reason\n", 1)
    cycle = "def f():\n    from lowbit.formats.planted_b import g    # cycle: planted_b imports this module\n"
    back = {"lowbit.formats.planted_b": "import lowbit.formats.planted_a\n"}

    def planted(check, a: str, **more: str) -> set[tuple[str, int]]:
        return {(s.path, s.line) for s in check(_planted({"lowbit.formats.planted_a": a, **more}))
                if "planted" in s.mod}

    assert planted(_unjustified_in_cleaned, repeat) == {("lowbit/formats/planted_a.py", 5)}
    assert planted(_unjustified_in_cleaned, lazy) == set()
    assert planted(_unjustified_in_cleaned, cycle, **back) == set()
    assert planted(_reason_unsaid, cycle, **back) == set()
    assert planted(_reason_unsaid, cycle.replace("# cycle", "# loop"), **back) == {("lowbit/formats/planted_a.py", 2)}


def test_the_classifier_on_a_small_tree():
    """Each rule on a tree small enough to see whole: relative imports, `import a.b as c`, a face's
    names, parent packages, TYPE_CHECKING blocks and optional packages."""
    tree = {
        "lowbit": ("", True),
        "lowbit.p": ("from . import low\n", True),                       # the package imports its child
        "lowbit.p.low": ("def f():\n    from .high import x\n"           # cycle: high names the package
                         "def g():\n    import lowbit.p.high as h\n"
                         "def h():\n    from lowbit.p.plain import z\n", False),  # p runs already: no cycle
        "lowbit.p.high": ("from lowbit import p\n", False),              # names its parent: half-built
        "lowbit.p.plain": ("import torch\n", False),
        "lowbit.q": ("def f():\n    from lowbit.p.low import f\n"        # plain repeat
                     "def g():\n    from lowbit.r import x\n"            # optional: ext
                     "def h():\n    from lowbit.face import F\n"         # optional through the face
                     "def i():\n    from lowbit.s import y\n", False),   # s imports q only for typing
        "lowbit.q2": ("import ext\ndef f():\n    from lowbit.r import x\n", False),  # loads ext already
        "lowbit.r": ("import ext.sub\nimport os, torch\n", False),
        "lowbit.s": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lowbit.q\n", False),
        "lowbit.face": ("import importlib\n_EXPORTS = {'F': 'lowbit.r'}\n\n\ndef __getattr__(name):\n"
                        "    from lowbit import q\n    return importlib.import_module(_EXPORTS[name])\n", True),
    }
    g = Graph(tree)
    reasons = {(s.mod, s.line): g.reasons(s) for s in g.local_imports()}
    assert reasons == {
        ("lowbit.p.low", 2): ["cycle: lowbit.p.high imports lowbit.p.low"],
        ("lowbit.p.low", 4): ["cycle: lowbit.p.high imports lowbit.p.low"],
        ("lowbit.p.low", 6): [],
        ("lowbit.q", 2): [],
        ("lowbit.q", 4): ["optional: ext"],
        ("lowbit.q", 6): ["optional: ext"],
        ("lowbit.q", 8): [],
        ("lowbit.q2", 3): [],
    }
    assert [s.where for s in g.statements if s.mod == "lowbit.s"] == ["module", "typing"]
    assert [s.where for s in g.statements if s.mod == "lowbit.face"] == ["module", "face"]
