"""Sibling layers that took the native decode classes (lowbit.ops.kernels.native) share one input only where
their concatenated operands are the native layout of the concatenated weight: the layouts pad N to tiles of
16 rows, so every member but the last must fill its tiles. No sm_90 GPU here: an H200 stands in as the kernel
device and the library is said to run; nothing is launched, the merged operands are read back through the
layout's inverse (lowbit.ops.native.layout) and compared with the members' codes bit for bit."""
import pytest
import torch

import lowbit as lb
from lowbit.nn import QuantLinear
from lowbit.nn.shared_input import share_inputs
from lowbit.ops.kernels import dense
from lowbit.ops.kernels import native as kn
from lowbit.ops.kernels.base import Device
from lowbit.ops.native import layout

SCHEMES = {"native_w8a16": lb.get_preset("int8_channel"),
           "native_w4a16": lb.QuantScheme(format="int4", strategy="group", group_size=32, symmetric=False)}


@pytest.fixture
def native_choosable(monkeypatch):
    monkeypatch.setattr(kn.library, "unavailable_reason", lambda: None)
    monkeypatch.setattr(dense, "kernel_device", lambda: Device("cuda", (9, 0)))


def _codes_of(shared, kernel: str, N: int, K: int) -> torch.Tensor:
    if kernel == "native_w8a16":
        return layout.unarrange_w8(shared.fast_n_packed, N, K).view(torch.int8)
    return layout.unarrange_w4(shared.fast_n_packed, N, K)


@pytest.mark.parametrize("kernel", sorted(SCHEMES))
def test_members_merge_only_where_each_but_the_last_fills_its_tiles(kernel, native_choosable, rng):
    K = 32 * int(torch.randint(2, 6, (1,), generator=rng))
    odd = 16 * int(torch.randint(1, 4, (1,), generator=rng)) + int(torch.randint(1, 16, (1,), generator=rng))
    for Ns, merges in (((48, 16, odd), True), ((odd, 16, 32), False), ((32, odd, 16), False)):
        parent = torch.nn.Module()
        with kn.opted_in():
            for name, N in zip(("q_proj", "k_proj", "v_proj"), Ns):
                w = lb.quantize(torch.randn(N, K, generator=rng), SCHEMES[kernel])
                parent.add_module(name, QuantLinear(w, w.scheme, None))
        layers = [parent.q_proj, parent.k_proj, parent.v_proj]
        assert all(m.kernel_choice.name == kernel for m in layers)
        codes = torch.cat([m.weight_q.codes.to(torch.int8) for m in layers])
        assert bool(share_inputs(parent)) == merges, Ns
        if merges:
            shared = parent.lowbit_shared_q_k_v
            assert shared.spec.N == sum(Ns) and shared.spec.kernel == kernel
            assert torch.equal(_codes_of(shared, kernel, sum(Ns), K), codes)
