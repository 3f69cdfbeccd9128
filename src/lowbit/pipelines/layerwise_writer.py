"""The output side of the layer-by-layer pipeline (lowbit.pipelines.layerwise): each quantized
decoder layer described in compressed-tensors' terms and written, the tensors outside the layers
copied, and the config, lowbit's sidecar and the side files written at the end: the files
quantize_model + save_compressed write for the same model.

The embedding, the final norm and lm_head are copied from the input shards to the output file to
file (bytes as they are, by the kernel; converted only where the compute dtype differs), never
loaded onto the device, into shards of their own ("rest"), by a thread of their own from the
start, beside the layers' shards. Each layer's tensors are written by one writer thread, in layer
order, so the files are the same bytes whatever the timing; at most WRITE_QUEUE layers wait on the
host for it. The routed experts are written one Linear per expert and projection under the family's
checkpoint names (lowbit.pipelines.moe_checkpoint), as save_compressed writes them.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lowbit.nn.quant_linear import QuantLinear
from lowbit.pipelines import moe_checkpoint as MC
from lowbit.pipelines.checkpoint import (build_quantization_config, DEFAULT_SHARD_BYTES, describe_qlayer,
                                         describe_qtensor, expand_deferred, module_tensors, write_metadata)
from lowbit.pipelines.layerwise_plan import LayerwisePlan
from lowbit.pipelines.tensorwise import copy_side_files
from lowbit.io.st_format import ShardedWriter

# Layers whose tensors may wait on the host for the writer thread (each up to one quantized
# layer: 218 MB for a W8A8 Llama-8B layer): 2 absorbs a slow write without stalling the layer loop
# (on two GPUs a layer can be produced about as fast as one is written).
WRITE_QUEUE = 2


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """t on the host (page-locked when pin: a GPU's copy runs at full speed)."""
    if not pin or t.device.type == "cpu":
        return t.to("cpu")
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t)
    return buf


class LayerwiseWriter:
    """The output checkpoint of one layer-by-layer run, written into the staging directory `tmp`
    (None: this rank writes nothing, but every layer is still described, so that what the writer
    would refuse is refused on every rank). busy: the threads' seconds ("copy_rest", "write"),
    added to as they work. Call shutdown() in any case, and finish() when every layer is in."""

    def __init__(self, plan: LayerwisePlan, tmp: Path | None, dtype: torch.dtype, max_shard_bytes: int | None,
                 busy: dict):
        self.plan, self.tmp, self.dtype, self.busy = plan, tmp, dtype, busy
        files = len(plan.ckpt.files)
        # each shard's header written in the space kept for it at its start (no copy of the data
        # behind a header at the end): room for ~6 output tensors per input tensor
        self.layers = (ShardedWriter(tmp, max_shard_bytes or DEFAULT_SHARD_BYTES,
                                     header_reserve=-(-256 * 6 * files // 8) * 8)
                       if tmp is not None else None)
        # the tensors outside the layers go to shards of their own, written by a thread of their
        # own from the start (embedding and lm_head: 2 GB for Llama-8B), beside the layers'
        self.rest = (ShardedWriter(tmp, max_shard_bytes or DEFAULT_SHARD_BYTES, tag="rest",
                                   header_reserve=-(-256 * files // 8) * 8)
                     if tmp is not None else None)
        self.layer_schemes: dict = {}
        self.sidecar: dict = {}
        self.targets: dict = {}
        self._write_thread = ThreadPoolExecutor(max_workers=1)
        self._rest_thread = ThreadPoolExecutor(max_workers=1)
        self._written: list = []        # the layers' write futures, oldest first
        self._rested = None

    def copy_rest(self) -> None:
        """Start copying the tensors outside the layers (streamed, never on the device)."""
        if self.layers is not None:
            self._rested = self._rest_thread.submit(self._copy_rest)

    def _copy_rest(self) -> None:
        t0 = time.time()
        ckpt = self.plan.ckpt
        for n in sorted(ckpt.files):
            if n not in self.plan.own:
                path, begin, fdtype, shape = ckpt.span(n)
                if fdtype.is_floating_point and fdtype != self.dtype:
                    self.rest.add(n, ckpt.get(n).to(self.dtype))
                else:        # bytes as they are: copied file to file by the kernel
                    self.rest.add_from_file(n, fdtype, shape, path, begin)
        self.busy["copy_rest"] += time.time() - t0

    def describe(self, layer: torch.nn.Module, prefix: str) -> tuple[dict, dict]:
        """(formats, experts sites) of a quantized layer (prefix: "model.layers.3."): each
        QuantLinear's and each quantized experts module's compressed-tensors scheme and lowbit
        record, kept for the config and the sidecar; save_compressed's per-expert check."""
        plan = self.plan
        formats, layer_sites = {}, {}
        for n, m in layer.named_modules():
            full = prefix + n
            if isinstance(m, QuantLinear):
                stored = MC.rename(full, plan.renamed)
                formats[full], self.layer_schemes[stored], self.sidecar[stored] = describe_qlayer(stored, m)
            elif full in plan.sites:      # written per expert, as save_compressed writes them
                site = layer_sites[full] = dataclasses.replace(plan.sites[full], module=m)
                if not site.quantized:
                    continue
                MC.check_savable(site, plan.cfg)
                for lname, qt in MC.expert_qtensors(site):
                    formats[full], self.layer_schemes[lname], self.sidecar[lname] = describe_qtensor(
                        lname, qt, m.weight_scheme, m.act_scheme)
                    self.targets[lname] = MC.block_pattern(site)
        return formats, layer_sites

    def write(self, layer: torch.nn.Module, prefix: str, formats: dict, layer_sites: dict, pin: bool) -> None:
        """Hand the layer's tensors to the writer thread (nothing on a rank that does not write)."""
        if self.layers is None:
            return
        # tensors on the device are copied to the host here (the layer is freed by the caller;
        # GPTQ's W4A16 codes are packed into int32 words on the device first); the checkpoint
        # layout of codes already on the host (a QuantLinear with its host twin: int4 packing on
        # the CPU, ~0.35 s for a Llama-8B layer) is made by the writer thread while the next layer
        # computes
        out = [(n, t if callable(t) else _to_host(t, pin))
               for n, t in module_tensors(layer, formats, set(), prefix[:-1], defer_host=True,
                                          experts=layer_sites)]
        while len(self._written) >= WRITE_QUEUE:   # at most WRITE_QUEUE layers wait on the host
            self._written.pop(0).result()            # (and a writer's error surfaces here)
        self._written.append(self._write_thread.submit(self._write, out))

    def _write(self, ts: list) -> None:
        t0 = time.time()
        for n, t in expand_deferred(ts):
            self.layers.add(MC.rename(n, self.plan.renamed), t)
        self.busy["write"] += time.time() - t0

    def shutdown(self) -> None:
        """Wait for the threads' work and stop them."""
        for ex in (self._write_thread, self._rest_thread):
            ex.shutdown(wait=True)

    def wait(self) -> None:
        """Every write done (a thread's error raised here)."""
        for fut in (*self._written, self._rested):
            if fut is not None:
                fut.result()

    def finish(self) -> list:
        """The shards (the rest's first), config.json with its quantization_config, lowbit's
        sidecar and the input's side files; returns the shards' file names."""
        plan = self.plan
        shards = self.rest.finish(self.layers)
        out_cfg = dict(plan.cfg)
        out_cfg["quantization_config"] = build_quantization_config(self.layer_schemes, sorted(set(plan.unquantized)),
                                                                   self.targets)
        write_metadata(self.tmp, out_cfg, plan.recipe.name, self.sidecar)
        copy_side_files(plan.in_dir, self.tmp)
        return shards
