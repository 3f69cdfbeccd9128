"""Which prepared decode calls run computing torch operations between their kernel launches
(lowbit.ops.bound refuses to record those: such a call falls back to a CUDA-graph replay with an
input copy and output clone, ~60 us of host time on the H200). Found on the CPU: every graphable
dense kernel class, the W4A16 layouts, at decode rows, with the GPU's split-K factors
(w4a16.configs.GPU_SPLIT_IN_INTERPRETER), each call watched by bound.computing_ops.

REFUSES_PLAN lists the kinds known to refuse, with why: a fix makes its test fail until its
entry is removed, so the list only shrinks."""
import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import _disable_current_modes

from lowbit.nn import QuantLinear, get_recipe
from lowbit.ops import bound, prepared
from lowbit.ops.kernels import dense_w4
from lowbit.ops.triton import w4a16 as w4k
from lowbit.ops.w4a16 import configs, launch
from lowbit.ops.weight_only import prepare_w4
from lowbit.recipes.presets import LM_HEAD, RECIPES

pytestmark = pytest.mark.usefixtures("interpreter")      # CPU tensors through Triton's interpreter

# case -> why its decode call computes in torch (the op names the test saw, as of this list)
REFUSES_PLAN = {
    "w8a8-int8-tensor": "one dynamic int8 scale per tensor: quantize_tensor_int8 runs in torch between the "
                        "launches (_to_copy, abs, amax, div, eq, where, ones_like, round, maximum, minimum, neg)",
}
# never recorded (their class is not graph_safe: prepared.forward tries no plan), so not watched
NOT_GRAPHABLE = {"mxfp8", "mxfp4", "nvfp4"}
ROWS = (1, 5, 16, 40)
reduce = w4k.reduce_split_k   # the real one, which the spy below calls

CASES = [(name, "auto") for name in list(RECIPES) + ["w8a16-fp8"]] + \
        [(name, layout) for name in ("w4a16", "w4a16-asym") for layout in ("planar_chunks", "planar8")]


@pytest.fixture
def gpu_split(monkeypatch):
    """The GPU's split-K factors in the interpreter, and the interpreter's own host work (copying
    arguments in and out of numpy) kept out of the watched ops: on the GPU a launch is one call."""
    monkeypatch.setattr(configs, "GPU_SPLIT_IN_INTERPRETER", True)
    monkeypatch.setattr(launch, "_PAIRS_LAUNCH", {})      # configurations cached without the flag
    run = interpreter.GridExecutor.__call__

    def unwatched(self, *args, **kwargs):
        with _disable_current_modes():
            return run(self, *args, **kwargs)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", unwatched)


def _layer(rng, name, layout, N, K, monkeypatch):
    if layout != "auto":   # the prepared path lays 4-bit weights out as "pairs" where they fit
        monkeypatch.setattr(dense_w4, "prepare_w4", lambda wq: prepare_w4(wq, layout=layout))
    r = LM_HEAD["fp8"] if name == "w8a16-fp8" else get_recipe(name)
    lin = torch.nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=rng) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=rng) * 0.1)
    return QuantLinear.from_linear(lin, r.weight, r.act, backend="kernel")


@pytest.mark.parametrize("name,layout", CASES, ids=lambda v: v)
def test_decode_calls_run_no_torch_compute_between_launches(rng, gpu_split, monkeypatch, name, layout):
    # N odd (no tile multiple); K = 2048: the GPU's heuristics split K at these rows (a K with an odd
    # number of 128-code chunks is never split, so it would not exercise split-K)
    N, K = 2 * int(torch.randint(16, 32, (1,), generator=rng)) + 1, 2048
    q = _layer(rng, name, layout, N, K, monkeypatch)
    spec = q.fast_spec
    assert spec is not None and spec.graphable == (name not in NOT_GRAPHABLE), (name, spec)
    if not spec.graphable:
        return
    if layout != "auto":
        assert spec.layout == layout
    ops = {n: getattr(q, "fast_" + n) for n in spec.operands}
    reduces = []
    monkeypatch.setattr(w4k, "reduce_split_k", lambda *a: reduces.append(a[0].shape[0]) or reduce(*a))
    seen = {}
    for M in ROWS:
        x = torch.randn(M, K, generator=rng).bfloat16()
        prepared.run(spec, x, ops, q.bias)      # the first call is direct in prepared.forward too
        _, bad = bound.computing_ops(prepared.run, spec, x, ops, q.bias)
        if bad:
            seen[M] = sorted(set(bad))
    if layout != "auto":   # the planar layouts' split-K path ran (partials summed by the reduction)
        assert reduces and min(reduces) > 1, reduces
    elif getattr(spec, "layout", None) == "pairs":   # the pairs kernel split K at some of these rows
        assert max(cfg["split"] for cfg, _ in launch._PAIRS_LAUNCH.values()) > 1
    if name in REFUSES_PLAN:
        assert seen, f"{name} no longer computes in torch between launches: remove it from REFUSES_PLAN"
    else:
        assert not seen, f"{name} ({layout}) runs computing torch ops between launches, per rows: {seen}"



def test_interpreter_splits_as_the_gpu_only_when_asked(monkeypatch):
    """GPU_SPLIT_IN_INTERPRETER: off, the interpreter never splits; on, it takes the GPU's factor
    (here one that divides the interpreter's K steps, so unchanged)."""
    args = (16, 45, 2048, "int4", 128, 128)
    gpu = configs.pick_config(*args)["split"]
    assert gpu > 1 and configs.pick_config(*args, interpret=True)["split"] == 1
    monkeypatch.setattr(configs, "GPU_SPLIT_IN_INTERPRETER", True)
    assert configs.pick_config(*args, interpret=True)["split"] == gpu
