"""Recorded launch plans (lowbit.ops.bound): what a plan replays, and every call it must refuse.
On the CPU the launches are a stand-in compiled kernel whose `run` does its arithmetic in torch,
recorded through the same hook lowbit.ops.triton.common.launch calls; the CUDA test replays the
real kernels of each recipe's decode call against their direct launches."""
import pytest
import torch

from lowbit.ops import bound


class _FakeCompiled:
    """A compiled kernel's launcher interface: run(g0, g1, g2, stream, fn, meta, *hooks, *args)."""

    function = packed_metadata = None

    def __init__(self, body):
        self.body, self.calls = body, 0

    def run(self, g0, g1, g2, stream, function, meta, h0, h1, h2, *args):
        self.calls += 1
        self.body(*args)


def _two_launches(rng):
    """act 'quantize' into an intermediate buffer, then a GEMM reading it: the W8A8 shape of a call."""
    w = torch.randn(7, 5, generator=rng)
    k1 = _FakeCompiled(lambda x, q, n: q.copy_(x.round()))
    k2 = _FakeCompiled(lambda q, w_, out, n: out.copy_(q @ w_.T))

    def call(x):
        q = torch.empty_like(x)
        bound.note_launch(k1, (x.shape[0],), (x, q, x.shape[1]), ())
        out = torch.empty(x.shape[0], w.shape[0])
        bound.note_launch(k2, (1, 2), (q, w, out, 7), ())
        return out
    return call, w, (k1, k2)


def test_plan_replays_launches_on_new_inputs(rng):
    call, w, kernels = _two_launches(rng)
    for _ in range(3):   # every replay: fresh input, fresh output, earlier outputs untouched
        x0 = torch.randn(3, 5, generator=rng) * 4
        out0, plan, why = bound.record(call, x0)
        assert why is None and plan is not None
        # recording itself does not run the fake kernels' bodies (note_launch only records): the
        # replay does, so compare the replay with the arithmetic written out
        outs = []
        for _ in range(4):
            x = torch.randn(3, 5, generator=rng) * 4
            y = plan(x, 0)
            assert torch.equal(y, x.round() @ w.T)
            outs.append((y, y.clone()))
        assert all(torch.equal(a, b) for a, b in outs)
        assert len({a.data_ptr() for a, _ in outs}) == len(outs)


def test_plan_refuses_computing_ops_views_and_slow_launches(rng):
    w = torch.randn(4, 5, generator=rng)
    k = _FakeCompiled(lambda *a: None)
    x = torch.randn(2, 5, generator=rng)

    def zeroing(a):          # split-K style: a zero fill the replay would not repeat
        out = torch.zeros(2, 4)
        bound.note_launch(k, (1,), (a, w, out), ())
        return out

    def view_of_input(a):    # a view of x kept as a constant argument would go stale
        out = torch.empty(2, 4)
        bound.note_launch(k, (1,), (a.view(10), w, out), ())
        return out

    def slow(a):
        bound.note_slow_launch()
        return torch.empty(2, 4)

    def output_unwritten(a):
        out = torch.empty(2, 4)
        bound.note_launch(k, (1,), (a, w), ())
        return out

    def foreign(a):          # a launch that is not Triton's (lowbit's native kernels, through ctypes)
        bound.note_unrecordable("a native sm_90a kernel launched through ctypes")
        out = torch.empty(2, 4)
        bound.note_launch(k, (1,), (a, w, out), ())
        return out

    for fn, word in ((zeroing, "torch operations"), (view_of_input, "view of the input"),
                     (slow, "Triton's own path"), (output_unwritten, "writes the returned output"),
                     (foreign, "launched through ctypes")):
        _, plan, why = bound.record(fn, x)
        assert plan is None and word in why, (fn.__name__, why)
    assert bound._RECORDING is None      # the recorder is reset after every call, refused or not


def test_plan_with_slots_serves_another_layer(rng):
    """Recorded with the layer's weight as a slot, a plan keeps its position, not the tensor: a replay
    with another layer's weight computes with that weight; a view of a slot is replayed as a pointer
    at the same offset into the new slot (never the recording layer's memory)."""
    w0, w1 = torch.randn(7, 5, generator=rng), torch.randn(7, 5, generator=rng)
    k = _FakeCompiled(lambda x, w_, out: out.copy_(x @ w_.T))

    def call_with(w_):
        def call(x):
            out = torch.empty(x.shape[0], w_.shape[0])
            bound.note_launch(k, (1,), (x, w_, out), ())
            return out
        return call
    _, plan, why = bound.record(call_with(w0), torch.randn(3, 5, generator=rng), slots=(w0,))
    assert why is None
    x = torch.randn(3, 5, generator=rng)
    assert torch.equal(plan(x, 0, (w1,)), x @ w1.T) and torch.equal(plan(x, 0, (w0,)), x @ w0.T)

    def view_of_slot(a):     # the launch reads a view of the weight: replayed as a pointer into the slot
        out = torch.empty(3, 7)
        bound.note_launch(k_ptr, (1,), (a, w0.view(torch.int32)[1:], out), ())
        return out
    k_ptr = _FakeCompiled(lambda x, p, out: seen.append(p))
    seen = []
    _, plan, why = bound.record(view_of_slot, x, slots=(w0,))
    assert why is None
    plan(x, 0, (w1,))
    assert seen == [w1.data_ptr() + 5 * 4]   # one row of five int32 words past w1's start, as the view was past w0's


def test_plan_recording_is_reset_after_an_error(rng):
    def boom(a):
        raise RuntimeError("kernel failed")
    with pytest.raises(RuntimeError, match="kernel failed"):
        bound.record(boom, torch.randn(2, 3, generator=rng))
    assert bound._RECORDING is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="recorded plans replay CUDA kernels")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w8a8-fp8", "w8a16-int8", "w4a16"])
@pytest.mark.parametrize("M", [1, 5, 16, 40])
def test_decode_plans_match_direct_launches(rng, recipe, M):
    """The second and later eager calls of a decode-sized input replay the recorded plan: each
    gives the direct launches' output bit for bit (one summation order per kernel: W4A16's split-K
    partials are added in a fixed order), earlier outputs are never overwritten."""
    from lowbit.nn import QuantLinear, get_recipe
    from lowbit.ops import prepared as runtime

    lin = torch.nn.Linear(512, 200)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 512, generator=rng) * 0.05)
    r = get_recipe(recipe)
    q = QuantLinear.from_linear(lin, r.weight, r.act).to("cuda")
    ops = {n: getattr(q, "fast_" + n) for n in q.fast_spec.operands}
    kept = []
    for _ in range(4):
        x = (torch.randn(M, 512, generator=rng)).to("cuda", torch.bfloat16)
        y = q(x)
        assert torch.equal(y, runtime.run(q.fast_spec, x, ops, q.bias))
        kept.append((y, y.clone()))
    assert any(isinstance(v, bound.Plan) for v in q._graphs.values()), bound.REFUSALS
    assert all(torch.equal(a, b) for a, b in kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="recorded plans replay CUDA kernels")
@pytest.mark.parametrize("recipe", ["w8a8-int8", "w4a16"])
@pytest.mark.parametrize("M", [1, 16])
def test_compiled_calls_replay_one_plan_per_spec(rng, recipe, M):
    """torch.compile's default mode runs the lowbit::qlinear op; on the default stream its decode
    calls replay a plan shared by the layers of one spec, with each layer's operands as slots: two
    layers of one shape give their own direct launches' outputs bit for bit, call after call."""
    from lowbit.nn import QuantLinear, get_recipe
    from lowbit.ops import prepared as runtime

    r = get_recipe(recipe)
    layers = []
    for _ in range(2):
        lin = torch.nn.Linear(512, 512)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(512, 512, generator=rng) * 0.05)
        layers.append(QuantLinear.from_linear(lin, r.weight, r.act).to("cuda"))
    seq = torch.compile(torch.nn.Sequential(*layers))
    for _ in range(4):
        x = torch.randn(M, 512, generator=rng).to("cuda", torch.bfloat16)
        y = seq(x)
        want = x
        for q in layers:
            want = runtime.run(q.fast_spec, want, {n: getattr(q, "fast_" + n) for n in q.fast_spec.operands}, q.bias)
        assert torch.equal(y, want)
    spec = layers[0]._fast_json
    assert any(k[0] == spec and isinstance(v, bound.Plan) for k, v in runtime._OP_PLANS.items()), bound.REFUSALS


def test_launch_takes_the_cached_path_without_hooks(monkeypatch):
    """Triton 3.6 keeps empty HookChains as its launch hooks: only a chain holding a hook (a
    profiler's) may send launches down Triton's own path (an `is not None` test sent all of them)."""
    from triton import knobs

    from lowbit.ops.triton.common import _hooked
    chain = type(knobs.runtime.launch_enter_hook)()
    assert not _hooked(None) and not _hooked(chain)
    chain.add(lambda *a: None)
    assert _hooked(chain) and _hooked(lambda *a: None)
    assert not _hooked(knobs.runtime.launch_enter_hook) and not _hooked(knobs.runtime.launch_exit_hook)


def test_launch_refuses_runtime_arguments_passed_as_keywords(rng, interpreter):
    """launch's cached path replays the first call's values of every parameter after the positional ones, so a
    runtime argument given as a keyword (or left to its default) would be stale on the GPU from the second call
    on: launch refuses it, in the interpreter too, naming the parameter; a correct call runs."""
    from lowbit.ops.triton.common import launch
    from lowbit.ops.triton.moe_route import _combine_kernel

    T, k, H = 3, 2, 40
    h, w = torch.randn(T * k, H, generator=rng), torch.rand(T, k, generator=rng)
    inv, out = torch.randperm(T * k, generator=rng), torch.empty(T, H)
    args = (h, w, inv, out, H, h.stride(0), w.stride(0), out.stride(0))
    with pytest.raises(TypeError, match=r"\['stride_o'\] not passed positionally"):
        launch(_combine_kernel, (T, 1), *args[:-1], stride_o=out.stride(0), TOP_K=k, BLOCK=64)
    with pytest.raises(TypeError, match=r"\['TOP_K'\] passed positionally"):
        launch(_combine_kernel, (T, 1), *args, k, BLOCK=64)
    launch(_combine_kernel, (T, 1), *args, TOP_K=k, BLOCK=64, enable_fp_fusion=False)
    want = (h[inv.reshape(T, k)] * w[..., None]).sum(1)             # two terms: the same sum in any order
    assert torch.equal(out, want)
