"""Sequential layer-wise calibration: each Linear is calibrated on the inputs it receives when every
Linear before it has already been replaced by its quantized version (GPTQ's and AWQ's order).

The model is walked block by block (the decoder layers: the first torch.nn.ModuleList whose
members hold Linears). The inputs of the first block are captured once (and, for a model whose
blocks get different keyword arguments -- config.layer_types mixing sliding-window and full
attention -- every block's own arguments: block_kwargs); within a block the
Linears are visited in execution order, grouped by shared input (q/k/v, gate/up), and each group's
inputs are collected by running the block with the already-replaced Linears and stopping as soon
as the group's input is seen. The block's outputs, with all of its Linears replaced, are the next
block's inputs. Linears outside the blocks are handled the same way on whole-model forwards,
after the blocks. Cost: about (groups per block / 2 + 1) forwards of each block per batch.

MoE experts modules (lowbit.archs.experts: a family's fused experts, not Linears) may be named
beside the Linears: each is a group of its own, and its handler gets, per batch, the module's
call arguments (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) as the block
passes them, i.e. the router's own choice for every token.

`calibrate_sequentially` is all-or-nothing: an error restores every replaced module.
"""
from __future__ import annotations

from typing import Callable, Iterable

import inspect

import torch

from lowbit.archs.experts import spec_for
from lowbit.archs.forward import run_batches
from lowbit.progress import progress_bar


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the wanted input has been seen."""


def decoder_blocks(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(name, ModuleList) of the repeated blocks: the first ModuleList with >= 2 members that hold Linears."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and all(
                any(isinstance(c, torch.nn.Linear) for c in b.modules()) for b in m):
            return name, m
    return None


def _no_cache(kwargs: dict) -> dict:
    # A captured KV cache would grow every time a block is re-run: drop it.
    out = {k: (None if "Cache" in type(v).__name__ else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _call(module: torch.nn.Module, args: tuple, kwargs: dict):
    return module(*args, **kwargs)


def _batch_call(b) -> tuple[tuple, dict]:
    return ((), dict(b)) if isinstance(b, dict) else ((b,), {})


def _stopped_at(mod: torch.nn.Module, record: Callable, root: torch.nn.Module, calls: Iterable) -> None:
    """root(*args, **kwargs) for each (args, kwargs) of `calls`, each forward ended where it enters
    `mod` (nothing after it runs): record(args, kwargs) gets what `mod` was called with."""
    def hook(m, args, kwargs):
        record(args, kwargs)
        raise _Stop

    h = mod.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for a, k in calls:
            try:
                _call(root, a, k)
            except _Stop:
                pass
    finally:
        h.remove()


@torch.no_grad()
def capture_block_inputs(model, block, batches) -> list[tuple[tuple, dict]]:
    seen = []
    _stopped_at(block, lambda args, kwargs: seen.append((args, _no_cache(kwargs))), model,
                (_batch_call(b) for b in batches))
    if not seen:
        raise ValueError("no calibration batch reached the model's first block: give at least one batch")
    return seen


def block_kwargs(model, blist, batches) -> list[list[dict]] | None:
    """Per block, per batch, the keyword arguments the model passes that block, when they differ
    between blocks: a model whose config.layer_types mixes attention types (gpt-oss, Gemma 2/3:
    sliding-window layers get another attention mask than full-attention ones). None when every
    block gets the same arguments (the first block's, captured once, serve all). One full forward
    per batch; the masks are shared tensors, not copies per block."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    if not types or len(set(types)) < 2:
        return None
    seen: list[list[dict]] = [[] for _ in blist]
    run_batches(model, batches, [b.register_forward_pre_hook(lambda m, a, k, i=i: seen[i].append(_no_cache(k)),
                                                             with_kwargs=True) for i, b in enumerate(blist)])
    if any(len(s) != len(list(batches)) for s in seen):
        raise ValueError("a decoder block was not called once per calibration batch: cannot give each block "
                         "its own arguments (attention masks)")
    return seen


def _with_kwargs(inputs: list[tuple[tuple, dict]], kwargs: list[dict]) -> list[tuple[tuple, dict]]:
    """inputs with each batch's keyword arguments replaced by `kwargs` (the hidden states kept)."""
    out = []
    for (a, k), kw in zip(inputs, kwargs):
        kw = dict(kw)
        if "hidden_states" in k:
            kw["hidden_states"] = k["hidden_states"]
        out.append((a, kw))
    return out


def _execution_groups(stage, inputs, names: list[str]) -> list[list[str]]:
    """Linears of `names` in the order the stage runs them, grouped by identical input tensor."""
    order, last = [], [None]

    def make(n):
        def hook(mod, args):
            x = args[0]
            if spec_for(mod) is not None:      # experts: a group of their own
                order.append([n])
                last[0] = None
                return
            if order and last[0] is x:
                order[-1].append(n)
            else:
                order.append([n])
            last[0] = x
        return hook

    hs = [stage.get_submodule(n).register_forward_pre_hook(make(n)) for n in names]
    try:
        with torch.no_grad():
            _call(stage, *inputs[0])
    finally:
        for h in hs:
            h.remove()
    done = {n for g in order for n in g}
    missing = [n for n in names if n not in done]
    if missing:
        raise ValueError(f"Linear layers {missing} never ran on the calibration batches: they cannot be calibrated")
    return order


@torch.no_grad()
def _collect(stage, inputs, name: str) -> list[torch.Tensor]:
    """The inputs (one tensor [..., K] per batch) that `name` receives, stopping each forward there
    (an experts module: a tuple of its call arguments per batch)."""
    got = []
    mod = stage.get_submodule(name)
    experts = spec_for(mod) is not None
    sig = inspect.signature(mod.forward) if experts else None

    def record(args, kwargs):
        if experts:         # every call argument, in the signature's order
            bound = sig.bind(*args, **kwargs)
            got.append(tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in bound.arguments.values()))
        else:
            got.append(args[0].detach())

    _stopped_at(mod, record, stage, inputs)
    return got


def _set(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


@torch.no_grad()
def next_block_inputs(block: torch.nn.Module, inputs: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """The next block's inputs: `block` run on each (args, kwargs) of `inputs`, its output in
    place of the hidden states (the other arguments, e.g. position embeddings, are shared)."""
    outs = [_call(block, a, k) for a, k in inputs]
    return [((o[0] if isinstance(o, tuple) else o,) + a[1:], k) if a else
            (a, {**k, "hidden_states": o[0] if isinstance(o, tuple) else o})
            for o, (a, k) in zip(outs, inputs)]


def as_kwargs(inputs: list[tuple[tuple, dict]]) -> list[dict]:
    """Block inputs as keyword dicts (hidden_states by name), the batch form calibration calls take."""
    return [{"hidden_states": a[0], **k} if a else dict(k) for a, k in inputs]


Handler = Callable[[list[str], list[torch.Tensor]], dict[str, torch.nn.Module]]

# Bytes of inputs and outputs _Reuse may hold for one stage (its copies of them).
REUSE_BYTES = 1 << 30


class _Reuse:
    """The outputs of the modules a handler put in place (GPTQ's QuantLinears: fixed once built),
    reused while one stage is calibrated. The stage runs from its start again for every later group
    (and once more for the next stage's inputs), calling each replaced module with the inputs it
    saw before; such a call returns a copy of the output it gave then instead of computing it
    again. The input is compared (torch.equal), not assumed, so the values are those the module
    would compute; inputs and outputs are kept as copies, so a caller that changes either in
    place changes nothing kept. A module handed back unchanged (AWQ's: a later fold may still
    change its weight) or taking more than one argument (experts) is not wrapped, and at most
    REUSE_BYTES are held (calls beyond it are computed as usual)."""

    def __init__(self):
        self.mods: list[torch.nn.Module] = []
        self.bytes = 0

    def wrap(self, mod: torch.nn.Module) -> None:
        if "forward" in mod.__dict__ or spec_for(mod) is not None:
            return
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        compute = mod.forward
        nxt = [0]       # the batches come in the same order on every run: try the next one first

        def forward(*args, **kwargs):
            x = args[0] if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) else None
            if x is not None and seen:
                for j in [nxt[0] % len(seen)] + list(range(len(seen))):
                    x0, y0 = seen[j]
                    if x0.shape == x.shape and x0.dtype == x.dtype and torch.equal(x0, x):
                        nxt[0] = j + 1
                        return y0.clone()
            y = compute(*args, **kwargs)
            if x is not None and isinstance(y, torch.Tensor):
                size = x.numel() * x.element_size() + y.numel() * y.element_size()
                if self.bytes + size <= REUSE_BYTES:
                    seen.append((x.detach().clone(), y.detach().clone()))
                    self.bytes += size
            return y

        mod.forward = forward
        self.mods.append(mod)

    def clear(self) -> None:
        for m in self.mods:
            m.__dict__.pop("forward", None)
        self.mods, self.bytes = [], 0


def run_stage(stage, inputs, names: list[str], handle: Handler, replaced: dict, prefix: str, bar,
              groups: list[list[str]] | None = None, reuse: _Reuse | None = None) -> list[list[str]]:
    """Replace the Linears `names` of `stage` group by group (handle), in execution order; returns
    the groups. groups: the execution groups when known (e.g. from an identical earlier decoder
    layer: lowbit.pipelines.layerwise), which saves the forward pass that finds them. reuse: the
    caller's _Reuse (it clears it after its own last run of the stage); None: one of its own,
    cleared on return."""
    own = reuse is None
    reuse = _Reuse() if own else reuse
    try:
        if groups is None:
            groups = _execution_groups(stage, inputs, names)
        for group in groups:
            xs = _collect(stage, inputs, group[0])
            new = handle([prefix + n for n in group], xs)
            for n in group:
                old = stage.get_submodule(n)
                replaced[prefix + n] = old
                _set(stage, n, new[prefix + n])
                if new[prefix + n] is not old:
                    reuse.wrap(new[prefix + n])
            if bar is not None:
                bar.update(len(group))
    finally:
        if own:
            reuse.clear()
    return groups


def calibrate_sequentially(model: torch.nn.Module, names: Iterable[str], batches: Iterable, handle: Handler,
                           *, progress: bool = False, desc: str = "calibrate") -> None:
    """Replace the Linears `names` of `model` in place, in execution order. For each group of
    Linears sharing one input, `handle(group_names, inputs)` gets the full names and the inputs
    (one float tensor [..., K] per batch, produced by the model with every earlier Linear already
    replaced) and returns {name: replacement module}. batches: input-id tensors [B, T] or dicts."""
    names = list(names)
    batches = list(batches)
    if not batches:
        raise ValueError("calibration needs at least one batch of inputs")
    replaced: dict[str, torch.nn.Module] = {}
    bar = None
    if progress:
        bar = progress_bar(total=len(names), desc=desc, unit="layer")
    try:
        blocks = decoder_blocks(model)
        todo = set(names)
        if blocks is not None:
            bname, blist = blocks
            inputs = capture_block_inputs(model, blist[0], batches)
            per_block = block_kwargs(model, blist, batches)
            for i, block in enumerate(blist):
                if per_block is not None:      # this block's own attention mask (layer types differ)
                    inputs = _with_kwargs(inputs, per_block[i])
                prefix = f"{bname}.{i}." if bname else f"{i}."
                mine = [n[len(prefix):] for n in names if n.startswith(prefix)]
                reuse = _Reuse()
                try:
                    if mine:
                        run_stage(block, inputs, mine, handle, replaced, prefix, bar, reuse=reuse)
                    todo -= {prefix + n for n in mine}
                    if i + 1 < len(blist):
                        inputs = next_block_inputs(block, inputs)
                finally:
                    reuse.clear()
        rest = [n for n in names if n in todo]
        if rest:
            run_stage(model, [_batch_call(b) for b in batches], rest, handle, replaced, "", bar)
    except BaseException:
        for n, m in replaced.items():
            _set(model, n, m)
        raise
    finally:
        if bar is not None:
            bar.close()
