"""Quantize each activation once: layers that read the same input share one GEMM.

In a Llama-family decoder, q/k/v_proj all read the attention norm's output and gate/up_proj
the MLP norm's. `share_inputs(model)` concatenates each such group's prepared operands along N
into one `SharedGEMM` (one activation quantization, one wide GEMM); the member QuantLinears
stay in the model under their own names (checkpoints, site reports and `check=True` read them
as before) and, on the fast path, return their column slice of the shared output.

The shared output is computed when the first member is called with an input and handed to
the others when they are called with *the same tensor object*; it is dropped once every
member has read it (so it never outlives the block). A member called with another input (a
model that does not share) gets a fresh computation, so the result is always the member's own
x @ W_member.T -- only the sharing is lost. An input modified in place between the members'
calls would go unnoticed (transformers' Llama code never does that).

Merging keeps the arithmetic of every column: per-channel and per-group weight scales are
per row of W, so concatenating rows changes no product, scale or rounding; per-token
activation scales are computed from the same x. Groups whose members differ in scheme, hold
per-tensor state (static activation scales, per-tensor weight scales; NVFP4 weight tensor scales
that differ, except in the "pairs" W4A16 layout, where they become one scale per output row), have no
fast path, or have a member other than the last whose rows do not fill its layout's tiles along N
(PreparedKernel.row_tile: 16 rows for the native decode classes) are left alone.
"""
from __future__ import annotations

import torch

from lowbit.ops import prepared as runtime
from lowbit.ops.kernels import prepared_class
from lowbit.nn.quant_linear import QuantLinear
from lowbit.ops.weight_only import pairs_fp4_exp_offset

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedGEMM(torch.nn.Module):
    """The concatenated operands of a group of QuantLinears reading one input."""

    def __init__(self, spec: runtime.Spec, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
                 members: int):
        super().__init__()
        self.spec, self._json = spec, spec.to_json()
        for n, t in tensors.items():
            self.register_buffer("fast_" + n, t, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.members = members
        self._x = self._y = None
        self._left = 0
        self._graphs = runtime.GraphCache()

    def _apply(self, fn, recurse=True):
        self._graphs.clear()  # captured graphs hold the old device pointers
        return super()._apply(fn, recurse)

    def output(self, x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """The group's [M, N_total] output for x2 = x as [M, K], computed once per input
        object x (the members' own argument: x2 is a fresh view on every call)."""
        if self._x is not x:
            bufs = self._buffers   # dict reads: nn.Module.__getattr__ costs ~1 us each per call
            self._y = runtime.forward(self.spec, self._json, x2, [bufs["fast_" + n] for n in self.spec.operands],
                                      bufs["bias"], self._graphs)
            self._x, self._left = x, self.members
        y = self._y
        self._left -= 1
        if self._left <= 0:
            self._x = self._y = None
        return y

    def extra_repr(self) -> str:
        return f"kind={self.spec.kind}, N={self.spec.N}, K={self.spec.K}, members={self.members}"


def _mergeable(layers: list) -> bool:
    first = layers[0]
    if not all(isinstance(m, QuantLinear) and m.fast_spec is not None for m in layers):
        return False
    if first.weight_scheme.strategy == "tensor":
        return False
    tile = prepared_class(first.fast_spec).row_tile
    if any(m.out_features % tile for m in layers[:-1]):
        return False    # a member's padded tile would sit between its rows and the next member's
    same = all(m.weight_scheme == first.weight_scheme and m.act_scheme == first.act_scheme
               and m.in_features == first.in_features and m.act_static_scale is None
               and m.backend == first.backend and m.fast_spec.operands == first.fast_spec.operands
               for m in layers)
    if not same:
        return False
    gs = [getattr(m, "fast_global_scale", None) for m in layers]
    # NVFP4 tensor scales that differ: one per output row in the merged GEMM (the pairs kernel's
    # epilogue takes a row vector; the other W4A16 layouts take one scale)
    return gs[0] is None or all(torch.equal(g, gs[0]) for g in gs) or first.fast_spec.layout == "pairs"


def share_inputs(model: torch.nn.Module, groups=GROUPS) -> list[str]:
    """Merge every group of sibling QuantLinears named in `groups` (default: Llama's q/k/v and
    gate/up; the pipelines pass the family's from lowbit.archs.decoders.sibling_groups, this
    runtime module sits below the map) into a SharedGEMM; returns the names of the parents
    changed. Idempotent."""
    done = []
    for pname, parent in list(model.named_modules()):
        for names in groups:
            layers = [getattr(parent, n, None) for n in names]
            if any(m is None for m in layers) or any(getattr(m, "_shared", None) for m in layers):
                continue
            if not _mergeable(layers):
                continue
            first = layers[0]
            spec = first.fast_spec
            tensors = {}
            for op in spec.operands:
                parts = [getattr(m, "fast_" + op) for m in layers]
                if op == "global_scale" and not all(torch.equal(p, parts[0]) for p in parts):
                    tensors[op] = torch.cat([p.reshape(1).expand(m.out_features) for p, m in zip(parts, layers)])
                else:
                    tensors[op] = parts[0] if op in runtime.PER_LAYER_OPERANDS else torch.cat(parts, 0)
            biases = [m.bias for m in layers]
            bias = None
            if any(b is not None for b in biases):
                dev = tensors[spec.operands[0]].device
                bias = torch.cat([b.detach().float().to(dev) if b is not None
                                  else torch.zeros(m.out_features, device=dev) for b, m in zip(biases, layers)])
            n_total = sum(m.out_features for m in layers)
            merged = {"N": n_total}
            if spec.w4kind == "mxfp4" and spec.layout == "pairs":
                # the folded MXFP4 scales' D belongs to the merged weight (the members' may differ)

                merged["fp4_exp_offset"] = pairs_fp4_exp_offset(tensors["packed"], tensors["scale_codes"])
            shared = SharedGEMM(runtime.Spec(**{**spec.__dict__, **merged}), tensors, bias, len(layers))
            parent.add_module("lowbit_shared_" + "_".join(n.split("_")[0] for n in names), shared)
            start = 0
            for m in layers:
                m.attach_shared(shared, start, start + m.out_features)
                start += m.out_features
            done.append(pname)
    return done


def prepare_model(model: torch.nn.Module, *, device=None, dtype: torch.dtype | None = None,
                  share: bool = True, groups=GROUPS) -> torch.nn.Module:
    """Ready a quantized model to serve: move it to `device`, cast what is not quantized to
    `dtype` (QuantLinear's kernel operands keep their own formats), and (share=True) merge the
    layers that read one input (share_inputs above; groups: the sibling names, from the caller's
    architecture map, lowbit.archs.decoders.sibling_groups). Returns the model (changed in place)."""
    if dtype is not None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={dtype} is not a model dtype; use torch.bfloat16, float16 or float32")
        model.to(dtype)
    if device is not None:
        model.to(device)
    if share:
        share_inputs(model, groups)
    return model
