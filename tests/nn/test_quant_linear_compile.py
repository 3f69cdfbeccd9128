"""QuantLinear under torch.compile and the host work of one eager call.

- fullgraph=True traces every path whole: the fast path is one custom op (torch.ops.lowbit.qlinear,
  its fake implementation run by aot_eager), the exact path's data-dependent checks become
  device-side asserts while tracing. The compiled output equals the eager one bit for bit (the
  same kernels, or the same torch ops, in the same order).
- A quantized model compiles without graph breaks (torch.compile's own counter).
- The Python work of one fast-path call is bounded: calls counted by a profiler with the kernel
  launches stubbed out (what is left is the per-call host work: dispatch, shapes, configs,
  allocations). A regression that adds per-call scheme lookups or config searches fails here,
  without timing anything.
"""
import collections
import sys

import pytest
import torch

from lowbit.nn import QuantLinear, get_recipe
from lowbit.recipes.presets import LM_HEAD

EXACT = ["w8a8-int8", "w8a8-int8-tensor", "w8a8-fp8", "w4a16", "mxfp8", "nvfp4"]
FAST = ["w8a8-int8", "w8a8-fp8", "w8a16-int8", "w4a16", "w4a16-asym", "mxfp8", "mxfp4", "nvfp4", LM_HEAD["fp8"]]
# Python calls of one fast-path forward at M = 1 with the launches stubbed, measured at 44-56 for
# the Triton-only kinds (module call, _fast_ok, prepared.forward / run, the launcher, its config
# pick, grid arithmetic); the bound leaves room for a few more, not for per-call searches
MAX_PY_CALLS = 80
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(rng, recipe, backend, n=40, k=256):
    r = get_recipe(recipe)
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=rng) * 0.1)
    return QuantLinear.from_linear(lin, r.weight, r.act, backend=backend)


def _compiled_equals_eager(q, x, backend):
    torch._dynamo.reset()
    f = torch.compile(q, fullgraph=True, dynamic=False, backend=backend)
    got = f(x)
    want = q(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("recipe", EXACT)
def test_exact_path_compiles_whole(rng, recipe):
    """The CPU's exact path (float32 in): no graph break, the compiled call first (a cold
    process: the format tables are built inside the trace)."""
    q = _layer(rng, recipe, "auto")
    x = torch.randn(5, 256, generator=rng)
    _compiled_equals_eager(q, x, "eager")


def test_exact_path_still_refuses_nan_when_compiled(rng):
    q = _layer(rng, "w8a8-int8", "auto")
    x = torch.randn(3, 256, generator=rng)
    x[1, 7] = float("nan")
    torch._dynamo.reset()
    f = torch.compile(q, fullgraph=True, dynamic=False, backend="eager")
    with pytest.raises(RuntimeError, match="non-finite"):
        f(x)


@pytest.mark.parametrize("recipe", FAST, ids=lambda r: getattr(r, "name", r))
def test_fast_path_compiles_whole_through_the_custom_op(rng, kernel_device, recipe):
    """bf16 in, the prepared fast path (Triton's interpreter on the CPU): aot_eager runs the
    op's fake implementation to trace, then the op itself."""
    q = _layer(rng, recipe, "kernel").to(kernel_device)
    x = torch.randn(3, 256, generator=rng).bfloat16().to(kernel_device)
    _compiled_equals_eager(q, x, "aot_eager")


def test_quantized_model_has_no_graph_breaks(rng):
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    from lowbit.pipelines.quantize_model import quantize_model
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, vocab_size=96)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=rng)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    quantize_model(model, "w8a8-int8", lm_head="int8", backend="kernel")
    model = model.bfloat16().to(DEV)
    ids = torch.randint(0, 96, (1, 6), generator=rng).to(DEV)
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, dynamic=False, backend="aot_eager")(ids).logits
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(got, want)


def _count_calls(fn) -> collections.Counter:
    calls = collections.Counter()

    def prof(frame, event, arg):
        if event == "call":
            calls[(frame.f_code.co_filename, frame.f_code.co_name)] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8", "w8a16-int8", "w4a16", "w4a16-asym"])
def test_host_work_per_call_is_bounded(rng, recipe, monkeypatch):
    """Python function calls of one decode-sized call (M = 1) on the fast path, the kernels'
    launches replaced by a no-op (the launcher itself is what a GPU call costs on the host
    besides them, lowbit.ops.triton.common.launch, measured separately on the H200)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("counts the interpreter's host path (CI); on CUDA, decode-sized calls replay a graph "
                    "(python -m lowbit.bench.layers times eager against graph there)")
    q = _layer(rng, recipe, "kernel")
    x = torch.randn(1, 256, generator=rng).bfloat16()
    q(x)                                    # first call: configs and caches are made here
    launched = []

    def no_launch(kernel, grid, *args, **meta):
        launched.append(kernel)
    for name, mod in list(sys.modules.items()):
        if name.startswith("lowbit.ops") and getattr(mod, "launch", None) is not None and callable(mod.launch):
            monkeypatch.setattr(mod, "launch", no_launch)
    calls = _count_calls(lambda: q(x))
    assert launched, "the stub saw no launch: the fast path was not taken"
    n = sum(calls.values())
    top = ", ".join(f"{k[1]} x{v}" for k, v in calls.most_common(8))
    assert n <= MAX_PY_CALLS, f"{recipe}: {n} Python calls per forward (most: {top})"
    # nothing in the call re-derives the scheme or the kernel choice
    names = {k[1] for k in calls}
    assert not names & {"prepared_kind", "prepare", "from_dict", "w4a16_kind", "get_format", "spec_from_json"}, names
