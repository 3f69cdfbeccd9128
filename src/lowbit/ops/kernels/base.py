"""What a kernel class is, and how dispatch asks the kernels of one registry in preference order.

A kernel class answers three questions for a layer (the idea of vLLM's MPLinearKernel):
- `can_run(layer, device) -> str | None`: None when it can run the layer on the device, else why
  not (a sentence naming the argument and what the kernel takes);
- how it lays out the layer's weights, once (`prepare`, on each registry's base class);
- how it applies them per call (`apply`).
It holds no per-layer state: what a layer keeps is its prepared tensors and a Spec naming the class,
so the per-call path finds the class without asking anything again.

`Registry.choose(layer, device)` asks the registered classes in order and returns a `Choice`: the
first that can run the layer (or None) and, for each better one, why it was refused. A class whose
layout step finds the layer's data unfit (a scale beyond a kernel's exact range) raises `Refused`
there and dispatch goes on to the next class, recording that reason as well.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from lowbit.ops import tuning
from lowbit.ops.kernels.schemes import have_triton
from lowbit.scheme import QuantScheme

DEVICE_KINDS = ("cuda", "interpreter", "cpu")


@dataclass(frozen=True)
class Device:
    """Where kernels would run: "cuda" (a GPU of this compute capability), "interpreter" (Triton
    installed, no GPU: its CPU interpreter runs the kernels, as the tests do) or "cpu" (no Triton:
    only the exact paths)."""
    kind: str
    capability: tuple[int, int] | None = None

    def __post_init__(self):
        if self.kind not in DEVICE_KINDS:
            raise ValueError(f"Device kind {self.kind!r}; choose one of {DEVICE_KINDS}")
        if (self.kind == "cuda") != (self.capability is not None):
            raise ValueError("Device: a 'cuda' device needs its capability (major, minor), other kinds none")

    def __str__(self) -> str:
        return f"cuda sm_{self.capability[0]}{self.capability[1]}" if self.capability else self.kind


@functools.lru_cache(maxsize=None)
def kernel_device() -> Device:
    """The device this process's Triton kernels run on: its first GPU, else Triton's interpreter, else
    none ("cpu"). Layers are prepared for it whatever device their weights are on now, so that a model
    quantized on the host runs its kernels after `.to("cuda")`."""
    if not have_triton():
        return Device("cpu")
    if torch.cuda.is_available():
        return Device("cuda", tuple(torch.cuda.get_device_capability(0)))
    return Device("interpreter")


def fp8_dot_accumulator(device: torch.device | str) -> str | None:
    """The accumulator lowbit's fp8 x fp8 Triton kernels (dense W8A8 fp8 and grouped fp8) declare on
    `device`, where it is not fp32: on a GPU the tensor cores keep 13 fraction bits within each
    32-wide MMA step (the kernels promote the partial sum into fp32 every 32 (grouped) or 128 (dense)
    products), which the gates model as "fp8_fast" (lowbit.verify.tolerance derives that gate for
    any K); the CPU interpreter computes the dot in float32 (None: the fp32 default)."""
    return "fp8_fast" if torch.device(device).type == "cuda" else None


@dataclass(frozen=True)
class LinearLayer:
    """The facts of a layer a kernel decides on: the weight's scheme and [N, K] shape, the activation
    scheme (None: weight-only), whether the weight's last group is zero-padded (K not a multiple of the
    group) and whether the activations have one static (calibrated) scale."""
    weight: QuantScheme
    act: QuantScheme | None
    N: int = 0
    K: int = 0
    padded: bool = False
    static_scale: bool = False


class Refused(Exception):
    """A kernel's layout step cannot hold this layer's data; the message is the reason."""


class Kernel:
    """One kernel. Subclasses set `name` (unique in its registry: what layers record and specs carry),
    `kind` (the runtime kind it implements, shared by the kernels that can stand in for each other), and
    implement `refuses`; `triton` and `min_capability` give the device refusals."""
    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    triton: ClassVar[bool] = True                            # needs Triton (a GPU or its interpreter)
    min_capability: ClassVar[tuple[int, int] | None] = None  # on a GPU: the tensor-core path it needs
    summary: ClassVar[str] = ""                              # one line for `lowbit doctor`

    @classmethod
    def can_run(cls, layer: LinearLayer, device: Device | None) -> str | None:
        """None when this kernel runs `layer` on `device`, else the reason (device None: the scheme
        question only)."""
        return (None if device is None else cls.device_refusal(device)) or cls.refuses(layer)

    @classmethod
    def device_refusal(cls, device: Device) -> str | None:
        if cls.triton and device.kind == "cpu":
            return "triton is not installed (pip install 'lowbit[gpu]')"
        need = cls.min_capability
        if need is not None and device.kind == "cuda" and device.capability < need:
            return f"needs a GPU of compute capability {need[0]}.{need[1]} or newer; this one is {device}"
        return None

    @classmethod
    def refuses(cls, layer: LinearLayer) -> str | None:
        raise NotImplementedError(f"{cls.__name__} must say which layers it refuses (refuses(layer))")


@dataclass(frozen=True)
class Choice:
    """Dispatch's answer for one layer: the kernel (None: no registered class runs it), what its
    layout step returned (`prepared`), and (name, reason) for each class asked before it."""
    kernel: type[Kernel] | None
    refused: tuple[tuple[str, str], ...] = ()
    prepared: Any = None

    @property
    def name(self) -> str | None:
        return None if self.kernel is None else self.kernel.name

    def report(self) -> str:
        """One line: the kernel and why the ones ahead of it were refused."""
        head = self.name or "no kernel"
        return head + "".join(f"; not {n}: {why}" for n, why in self.refused)


class Registry:
    """The kernel classes of one operation (dense prepared layers, QTensor GEMMs, grouped experts,
    attention calls: lowbit.ops.kernels.attention asks for an AttentionCall where the others ask for a
    LinearLayer), in preference order: the first that can run a layer runs it."""

    def __init__(self, what: str, kernels=()):
        self.what = what
        self._kernels: list[type[Kernel]] = []
        for k in kernels:
            self.register(k)

    def register(self, cls: type[Kernel], *, before: str | None = None) -> type[Kernel]:
        """Add a kernel class, last or ahead of the class named `before`; returns the class."""
        if not cls.name or not cls.kind:
            raise ValueError(f"{cls.__name__}: a kernel class needs a `name` and a `kind`")
        if cls.name in self.names():
            raise ValueError(f"{self.what}: a kernel named {cls.name!r} is registered already "
                             f"({self.get(cls.name).__name__}); give {cls.__name__} another name")
        at = len(self._kernels) if before is None else self.names().index(self.get(before).name)
        self._kernels.insert(at, cls)
        tuning.clear_choices()          # cached per-call resolutions name classes
        return cls

    def unregister(self, name: str) -> None:
        self._kernels.remove(self.get(name))
        tuning.clear_choices()

    @contextlib.contextmanager
    def registered(self, cls: type[Kernel], *, before: str | None = None):
        """`cls` registered for the duration of a with block (tests, experiments)."""
        self.register(cls, before=before)
        try:
            yield cls
        finally:
            self.unregister(cls.name)

    def names(self) -> list[str]:
        return [k.name for k in self._kernels]

    def __iter__(self):
        return iter(list(self._kernels))

    def get(self, name: str) -> type[Kernel]:
        for k in self._kernels:
            if k.name == name:
                return k
        raise ValueError(f"{self.what}: no kernel named {name!r}; registered: {', '.join(self.names())}")

    def choose(self, layer: LinearLayer, device: Device | None,
               prepare: Callable[[type[Kernel]], Any] | None = None) -> Choice:
        """Ask the kernels in order; `prepare(cls)` (optional) lays the layer out for the first that
        can run it, and a `Refused` from it moves on to the next class."""
        refused = []
        for cls in self._kernels:
            why = cls.can_run(layer, device)
            if why is None and prepare is not None:
                try:
                    return Choice(cls, tuple(refused), prepare(cls))
                except Refused as err:
                    why = str(err)
            if why is None:
                return Choice(cls, tuple(refused))
            refused.append((cls.name, why))
        return Choice(None, tuple(refused))
