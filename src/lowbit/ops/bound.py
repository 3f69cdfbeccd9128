"""Eager calls with little host time: a layer's kernel launches recorded once per input shape,
then replayed as direct launches of the compiled kernels.

Why: in eager decode a quantized Linear's GPU work takes microseconds, but going through its
launchers (configuration lookup, argument checks, Triton's binding of each argument, one
`torch.empty` per intermediate buffer) costs several times that on the host, and a CUDA-graph
replay of the layer needs an input copy and an output clone around it. A `Plan` keeps what one
call's launches were -- each compiled kernel, its grid and its argument list -- and a later call
with an input of the same rows, dtype, row stride and alignment only allocates its output and
calls each kernel's launcher with two slots of the argument list replaced (the input, the output).

What a plan may hold (checked while recording; anything else gives no plan, and the caller keeps
its other path):
- only Triton launches through lowbit.ops.triton.common.launch's cached path (a launch that says it cannot be
  held, note_unrecordable, gives no plan, with its reason), and torch
  allocations and views between them -- an operation that computes (a zero fill, a cast, a copy,
  an add) would not be repeated by the replay, so its presence refuses the plan;
- tensor arguments that are the input, the returned output, or tensors that do not alias either
  (the layer's operands, and intermediate buffers allocated by the call, which the plan keeps and
  reuses: a replay's kernels run in stream order after the previous call's, so reuse is safe on
  one stream; calls from several streams at once must not share a layer, as with graph replay).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten operations that only allocate or describe memory: a replay needs none of them (its
# intermediate buffers are kept, its output allocated afresh)
_ALLOWED = {"empty", "empty_strided", "empty_like", "view", "reshape", "_reshape_alias", "t", "expand", "alias",
            "as_strided", "slice", "select", "unsqueeze", "squeeze", "permute", "detach", "transpose",
            "_unsafe_view", "lift_fresh", "contiguous"}

_RECORDING: list | None = None
# why calls were not recorded, with how often (lowbit doctor / tests read it; a refused call keeps
# its other path, so this is a speed note, never an error)
REFUSALS: dict[str, int] = {}


def note_launch(ck, grid: tuple, args: tuple, tail: tuple) -> None:
    """Called by lowbit.ops.triton.common.launch for every launch on its cached path: while a
    plan is being recorded, remember the compiled kernel, grid and runtime arguments."""
    if _RECORDING is not None:
        _RECORDING.append((ck, grid, args, tail))


def note_unrecordable(why: str) -> None:
    """A launch a plan cannot hold (why: what it is, e.g. lowbit's native kernels, launched through ctypes):
    the call is not recorded, for that reason, and keeps its other path (a CUDA-graph replay of the layer)."""
    if _RECORDING is not None:
        _RECORDING.append(why)


def note_slow_launch() -> None:
    """A launch that did not take the cached path (interpreter, profiler hooks, TMA descriptors):
    the call cannot be replayed from recorded arguments."""
    if _RECORDING is not None:
        _RECORDING.append(None)


class _OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _ALLOWED:
            self.bad.append(name)
        return func(*args, **(kwargs or {}))


def computing_ops(fn, *args) -> tuple:
    """(fn(*args), the names of the torch operations it ran that compute -- those a plan refuses:
    anything but the allocations and views of _ALLOWED), in call order."""
    mode = _OpsSeen()
    with mode:
        out = fn(*args)
    return out, mode.bad


class Plan:
    """The recorded launches of one call: `plan(x2, stream, slots)` runs them on a new input x2 of the
    recorded rows, dtype, row stride and 16-byte alignment, into a fresh output; `slots` are the
    call's per-layer tensors where the plan was recorded with them (record(..., slots=)), so one plan
    serves every layer of one kind and shape."""

    __slots__ = ("launches", "out_shape", "out_dtype", "device")

    def __init__(self, launches, out: torch.Tensor):
        self.launches = launches
        self.out_shape, self.out_dtype, self.device = tuple(out.shape), out.dtype, out.device

    def __call__(self, x2: torch.Tensor, stream: int, slots: tuple = ()) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        for ck, g0, g1, g2, args, x_at, out_at, slot_at in self.launches:
            a = list(args)
            for i in x_at:
                a[i] = x2
            for i in out_at:
                a[i] = out
            for i, j, off in slot_at:     # a view of a slot: its pointer (Triton's launcher takes ints)
                a[i] = slots[j] if off is None else slots[j].data_ptr() + off
            ck.run(g0, g1, g2, stream, ck.function, ck.packed_metadata, None, None, None, *a)
        return out


def _aliases(t: torch.Tensor, other: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def record(fn, x2: torch.Tensor, slots: tuple = ()) -> tuple[torch.Tensor, Plan | None, str | None]:
    """Run `fn(x2)` once (its result is returned as the call's output) while recording its
    launches. Returns (output, plan or None, why not). `slots`: tensors the call passes to its
    kernels that a replay takes anew (the layer's operands): the plan keeps their positions (and a
    view's byte offset from its operand), not them; the caller keeps the slots' shapes, strides and
    16-byte alignment the same from call to call (the kernels were specialised on them)."""
    global _RECORDING
    if _RECORDING is not None:
        return fn(x2), None, "a plan is already being recorded"
    _RECORDING = seen = []
    try:
        out, bad = computing_ops(fn, x2)
    finally:
        _RECORDING = None
    plan, why = _plan(seen, bad, x2, out, tuple(slots))
    if why is not None:
        REFUSALS[why] = REFUSALS.get(why, 0) + 1
    return out, plan, why


def _plan(seen, bad, x2, out, slots):
    if bad:
        return None, f"the call runs torch operations a replay would skip: {sorted(set(bad))}"
    if not seen:
        return None, "the call launched no kernel"
    why = next((s for s in seen if isinstance(s, str)), None)
    if why is not None:
        return None, why
    if any(s is None for s in seen):
        return None, "a launch took Triton's own path (interpreter, profiler hook)"
    if not isinstance(out, torch.Tensor) or not out.is_contiguous() or out.storage_offset() != 0:
        return None, "the output is not a fresh contiguous tensor"
    launches, out_written = [], False
    for ck, grid, args, tail in seen:
        x_at, out_at, slot_at = [], [], []
        for i, a in enumerate(args):
            if hasattr(a, "block_shape"):   # a TMA descriptor: its base pointer is fixed inside it
                return None, f"argument {i} is a TMA descriptor"
            if not isinstance(a, torch.Tensor):
                continue
            j = next((j for j, t in enumerate(slots) if a is t), None)
            if a is x2:
                x_at.append(i)
            elif a is out:
                out_at.append(i)
                out_written = True
            elif j is not None:
                slot_at.append((i, j, None))
            elif _aliases(a, x2) or _aliases(a, out):
                return None, f"argument {i} is a view of the input or output (it would go stale)"
            else:
                # a view of a layer operand (e.g. its codes reinterpreted as int32 words): replayed as
                # that operand's pointer plus the same byte offset, so every layer of the spec reads its own
                j = next((j for j, t in enumerate(slots) if _aliases(a, t)), None)
                if j is not None:
                    slot_at.append((i, j, a.data_ptr() - slots[j].data_ptr()))
        g = tuple(grid) + (1,) * (3 - len(grid))
        launches.append((ck, g[0], g[1], g[2], tuple(args) + tuple(tail), tuple(x_at), tuple(out_at),
                         tuple(slot_at)))
    if not out_written:
        return None, "no launch writes the returned output"
    return Plan(tuple(launches), out), None
