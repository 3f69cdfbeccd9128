"""Round to nearest of one decoder layer's Linears in the layer-by-layer pipeline
(lowbit.pipelines.layerwise): by chunks of rows where the scheme allows, so the device holds one
chunk's float32 temporaries instead of three [N, K] ones, and shared out over the ranks under
torch.distributed (each rank quantizes a share, rank 0 receives the codes and writes). The codes
are those of quantize_model's quantize_layer, bit for bit."""
from __future__ import annotations

import torch

from lowbit.algorithms import distributed
from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines.quantize_model import quantize_layer
from lowbit.quantize import QTensor, quantize
from lowbit.recipes.plan import layer_act


# Elements per float32 temporary while a weight is quantized (row chunks; see rtn_codes).
_CHUNK = 1 << 22


_FIELDS = ("codes", "scale", "zero_point", "scale_codes")


def rtn_rows(summary, d, w: torch.Tensor) -> bool:
    """Whether `w` is quantized by row chunks (rtn_codes): a per-row scheme (channel / group,
    not two-level) and finite weights, checked by row chunks too (a whole-weight bool mask is
    N x K bytes: 56 MiB for [14336, 4096]). Otherwise quantize_layer quantizes it whole."""
    r = summary.recipe_of(d)
    step = max(1, _CHUNK // w.shape[1])
    return (r.weight.strategy in ("channel", "group") and not r.weight.two_level and
            bool(torch.stack([torch.isfinite(w[a:a + step]).all() for a in range(0, w.shape[0], step)]).all()))


def rtn_codes(w: torch.Tensor, scheme) -> dict:
    """The QTensor fields of quantize(w.float(), scheme, pad=True), computed by chunks of rows:
    per-row scales make that the same codes, and the device holds one chunk's float32
    temporaries instead of three [N, K] ones."""
    step = max(1, _CHUNK // w.shape[1])
    full = None
    for a in range(0, w.shape[0], step):   # each chunk's results straight into the whole weight's
        part = quantize(w[a:a + step].float(), scheme, pad=True)
        if full is None:
            full = {f: None if getattr(part, f) is None else
                    getattr(part, f).new_empty((w.shape[0],) + tuple(getattr(part, f).shape[1:])) for f in _FIELDS}
        for f in _FIELDS:
            if full[f] is not None:
                full[f][a:a + step] = getattr(part, f)
        del part
    return full


def rtn_linear(d, summary, linear: torch.nn.Linear, static, full: dict) -> torch.nn.Module:
    """quantize_layer's QuantLinear (round to nearest) from the fields of rtn_codes."""
    r = summary.recipe_of(d)
    act, scale = layer_act(d, r, static)
    qt = QTensor(full["codes"], full["scale"], full["zero_point"], r.weight, tuple(linear.weight.shape),
                 full["scale_codes"], None)
    bias = None if linear.bias is None else linear.bias.detach().float()
    return QuantLinear(qt, r.weight, act, bias=bias, act_static_scale=scale)


def rtn_chunked(d, summary, linear: torch.nn.Linear, static) -> torch.nn.Module:
    """quantize_layer's QuantLinear (round to nearest), by row chunks where the scheme allows."""
    w = linear.weight.detach()
    if not rtn_rows(summary, d, w):
        return quantize_layer(d, summary, linear, static)    # its checks and messages
    return rtn_linear(d, summary, linear, static, rtn_codes(w, summary.recipe_of(d).weight))


def rtn_split(layer: torch.nn.Module, names: list[str], by_name: dict, summary, static, prefix: str) -> None:
    """Round-to-nearest of the Linears `names` of `layer`, shared out over the ranks
    (distributed.owners, by weight size): each rank quantizes its share by row chunks, then
    each share's fields are broadcast from their owner (the process group's own communicator; for 2 ranks that is a send
    to rank 0), and rank 0 alone puts QuantLinears into its layer (only rank 0 writes; nothing
    runs the quantized layer). Every rank drops a Linear's float weight once it is quantized or
    sent for (the layer is not run again; rank 0's QuantLinear holds only the codes): otherwise the
    whole bf16 layer stays alive until the last Linear is done, beside half a layer of codes (for
    a Llama-8B layer: 416 + 208 MiB at the peak). A weight that needs quantize_layer whole
    (rtn_rows) is quantized on rank 0; every rank decides that the same way (the weights are the
    same on every rank). A collective."""
    me, world = distributed.rank(), distributed.world_size()
    lins = {n: layer.get_submodule(n) for n in names}
    rows = {n: rtn_rows(summary, by_name[prefix + n], lins[n].weight.detach()) for n in names}
    owner = dict(zip(names, distributed.owners([lins[n].weight.numel() if rows[n] else 0 for n in names], world)))
    owner.update({n: 0 for n in names if not rows[n]})

    def put(n, q):
        parent, _, attr = n.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, attr, q)

    def drop(n):                     # the float weight is not needed any more
        lins[n].weight.data = lins[n].weight.data.new_empty(0)

    kept = {}
    for n in names:                  # this rank's share
        if owner[n] != me:
            if owner[n] == 0:        # rank 0's share: this rank neither quantizes nor receives it
                drop(n)
            continue
        d = by_name[prefix + n]
        if not rows[n]:
            put(n, rtn_chunked(d, summary, lins[n], static))
            drop(n)
            continue
        full = rtn_codes(lins[n].weight.detach(), summary.recipe_of(d).weight)
        if me == 0:
            put(n, rtn_linear(d, summary, lins[n], static, full))
        else:
            kept[n] = full
        drop(n)
        del full
    for n in names:                  # the shares of ranks > 0, in the same order on every rank
        if owner[n] == 0:
            continue
        d = by_name[prefix + n]
        if owner[n] == me:
            full = kept.pop(n)
        else:                        # field dtypes and shapes from one row (per-row schemes)
            w = lins[n].weight.detach()
            probe = quantize(w[:1].float(), summary.recipe_of(d).weight, pad=True)
            full = {f: None if getattr(probe, f) is None else
                    getattr(probe, f).new_empty((w.shape[0],) + tuple(getattr(probe, f).shape[1:])) for f in _FIELDS}
            del probe
        for f in _FIELDS:
            if full[f] is not None:   # raw bytes: any dtype
                distributed.broadcast_(full[f].reshape(-1).view(torch.uint8), src=owner[n])
        if me == 0:
            put(n, rtn_linear(d, summary, lins[n], static, full))
        drop(n)
        del full
