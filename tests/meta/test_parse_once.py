"""A recipe, a KV-cache scheme and an LM-head kind are parsed from their names in one place for
everything above the pipelines: lowbit.workflows.job (QuantizeJob.build and its parse_* helpers).
The job then carries the resolved objects (Recipe, KVScheme, steps); the CLI, the workflow, the
experiments and the benchmarks call the job's parsers, never the name functions themselves.

The lower floors keep the name functions at their own boundary, where a Python caller may pass a
name (quantize_model(model, "w8a8-int8"), site_report(..., "w4a16")): each such module is listed
below with that reason, so a new caller anywhere is a decision this test makes visible."""
import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# the functions that turn a user's name into a typed object
PARSERS = {"get_recipe", "get_lm_head_recipe", "KVScheme.parse"}

THE_PARSER = "lowbit.workflows.job"

# lower-floor modules whose public functions accept `str | Recipe` / a scheme name from a Python caller
LIBRARY_BOUNDARIES = {
    "lowbit.recipes.presets", "lowbit.recipes.plan", "lowbit.recipes.compat",
    "lowbit.nn.kv_cache",                       # quantized KV cache from a checkpoint's scheme name
    "lowbit.algorithms.awq", "lowbit.algorithms.experts_fold",
    "lowbit.pipelines.quantize_model", "lowbit.pipelines.layerwise", "lowbit.pipelines.tensorwise",
    "lowbit.diagnosis.sites", "lowbit.diagnosis.site_kl", "lowbit.diagnosis.effects",
}
# top-floor modules that read a KV scheme's name stored in a file or a benchmark row, not a job
STORED_NAMES = {"lowbit.entrypoints.check_attention", "lowbit.bench.attention"}


def _calls_in(source: str) -> set[str]:
    """The PARSERS a module's source calls (anywhere: module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else \
            f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name in PARSERS:
            found.add(name)
    return found


def _callers() -> dict[str, set[str]]:
    out = {}
    for p in (SRC / "lowbit").rglob("*.py"):
        mod = ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        calls = _calls_in(p.read_text())
        if calls:
            out[mod] = calls
    return out


def test_names_are_parsed_by_the_job_module_only():
    callers = _callers()
    assert THE_PARSER in callers, "lowbit.workflows.job no longer parses names: update this test"
    stray = {m: sorted(c) for m, c in callers.items()
             if m != THE_PARSER and m not in LIBRARY_BOUNDARIES | STORED_NAMES}
    assert not stray, (f"{stray} parse names themselves; call lowbit.workflows.job's parse_recipe / parse_kv_cache "
                       "/ parse_lm_head (or pass the job's resolved objects) instead")


def test_the_quantize_path_calls_no_name_parser():
    """The modules a `lowbit quantize` run passes through hold typed objects, never a name to re-parse."""
    path = {"lowbit.entrypoints.quantize", "lowbit.entrypoints.quantize_args", "lowbit.entrypoints.sequential",
            "lowbit.workflows.quantize", "lowbit.workflows.steps", "lowbit.pipelines.steps",
            "lowbit.experiments.perplexity_table"}
    callers = _callers()
    assert not {m: callers[m] for m in path if m in callers}


def test_the_scan_sees_a_call():
    """The scanner itself: calls written either way, inside a function, are found; others are not."""
    src = "def f(x):\n    return get_recipe(x), KVScheme.parse('fp8'), parse_recipe(x), x.parse()\n"
    assert _calls_in(src) == {"get_recipe", "KVScheme.parse"}
