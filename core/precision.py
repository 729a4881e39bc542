"""The precision policy: which dtype each kind of tensor has under a plan's precision.

One object, recorded in the plan (``Training.precision`` and ``Training.reduce_dtype``)
and threaded through the runtime's composition (runtime/compose.py ``compose``), so
that no runtime file writes a dtype of its own. The cost model reads its byte
sizes from here too (passes/cost_model.py ``element_bytes``).

A mixed-precision policy (``bf16-mixed``, ``fp16-mixed``), as FSDP2's
``MixedPrecisionPolicy`` and Megatron's mixed-precision optimizer do it:

- parameters, their gradients and the activations are kept in the low-precision
  ``param_dtype`` (2 bytes each); matmuls run in it (``autocast``);
- the optimizer updates fp32 master weights (``master_dtype``), with its state
  (Adam's moments) in fp32, sharded as the plan's ZeRO stage says; after each
  step the masters are cast into the parameters (runtime/mixed_precision.py);
- gradients are reduced over data parallelism in ``reduce_dtype`` (fp32 by
  default, as FSDP2's default ``reduce_dtype``): each bucket is upcast for the
  collective and the mean cast back into the held gradient;
- fp16 needs loss scaling (its range is 6e-8 .. 65504): dynamic, halved and the
  step skipped on every rank when any gradient is inf or nan, doubled after
  ``growth_interval`` clean steps (as torch.amp.GradScaler).

``fp32`` keeps everything in fp32; ``bf16`` (pure, no masters) updates bf16
parameters directly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a dtype is made: the CLI's plan readers run without it
    import torch

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # plan name -> torch's name
DTYPES = tuple(_TORCH_NAMES)  # the plan's dtype names (a cluster's FLOP rates are given per one of them)
REDUCE_DTYPES = DTYPES
_COMPUTE = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}


def compute_dtype(precision: str) -> str:
    """The dtype matmuls run in under ``precision`` (a plan name: fp32, bf16, fp16)."""
    return _COMPUTE[precision]


@functools.lru_cache(maxsize=256)  # a pure function of a name, asked per tensor in the solvers' loops
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name stands for: a plan name ("fp32", "bf16", "fp16") or a torch one
    ("float32", "torch.int64", ...)."""
    import torch

    dtype = getattr(torch, _TORCH_NAMES.get(name, name.removeprefix("torch.")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a dtype")
    return dtype


def dtype_bytes(name: str) -> int:
    """Bytes of one element of dtype ``name`` (a plan or torch name; int64 is 8): the one table of
    element sizes, torch's own."""
    return torch_dtype(name).itemsize


def wire_bytes(what: str, held_bytes: float, reduce_dtype: str) -> float:
    """Bytes one element of a data-parallel collective carries: a gradient (``what`` "grads") in
    ``reduce_dtype``, whatever it is held in (the runtime casts each bucket to it for the collective:
    runtime/dp/buckets.py), a parameter ("params", ZeRO's all-gathers) as held, ``held_bytes``.
    ``what`` is passes/cost_model.py ``zero_collectives``' word."""
    return dtype_bytes(reduce_dtype) if what == "grads" else held_bytes


def is_floating(name: str) -> bool:
    """Whether dtype ``name`` is a floating type (held at the precision's size under a plan)."""
    return torch_dtype(name).is_floating_point


def keeps_masters(precision: str) -> bool:
    """Whether ``precision`` keeps fp32 master weights apart from the parameters (the mixed ones)."""
    return precision.endswith("-mixed")


def element_bytes(precision: str) -> int:
    """Bytes of one activation / weight / gradient element under ``precision``."""
    return dtype_bytes(compute_dtype(precision))


def activation_scale(precision: str, captured: str) -> float:
    """Bytes of a floating tensor under ``precision`` over its bytes as captured in dtype
    ``captured`` (the model's parameter dtype; fp32 when it has none): analyses measure saved and
    live bytes at the capture's dtype, a plan holds floating tensors at the precision's."""
    return element_bytes(precision) / dtype_bytes(captured or "float32")


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one plan's tensors (module docstring)."""

    precision: str = "fp32"
    reduce: str = "fp32"  # gradients are reduced in this dtype
    init_scale: float = 2.0**16  # fp16's first loss scale
    growth_interval: int = 2000  # clean steps before the scale doubles

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.reduce not in REDUCE_DTYPES:
            raise ValueError(f"reduce dtype {self.reduce!r} is not one of {', '.join(REDUCE_DTYPES)}")

    @classmethod
    def of(cls, training: object) -> PrecisionPolicy:
        """The policy a plan's training section records."""
        return cls(getattr(training, "precision", "fp32"), getattr(training, "reduce_dtype", "fp32"))

    @property
    def param_dtype(self) -> torch.dtype:
        """Parameters as the model computes with them, their gradients, and activations."""
        return torch_dtype(compute_dtype(self.precision))

    @property
    def master_dtype(self) -> torch.dtype:
        """What the optimizer updates (and holds its state in)."""
        return torch_dtype("fp32") if self.mixed or self.precision == "fp32" else self.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return torch_dtype(self.reduce)

    @property
    def mixed(self) -> bool:
        return keeps_masters(self.precision)

    @property
    def low(self) -> bool:
        """Anything below fp32 runs."""
        return self.precision != "fp32"

    @property
    def loss_scaling(self) -> bool:
        return compute_dtype(self.precision) == "fp16"

    @contextlib.contextmanager
    def autocast(self, device: torch.device | str) -> Iterator[None]:
        """The forward's context: matmuls in ``param_dtype`` (nothing under fp32)."""
        if not self.low:
            yield
            return
        import torch

        kind = torch.device(device).type
        with torch.autocast(device_type=kind, dtype=self.param_dtype):
            yield

    def wire(self, t: torch.Tensor) -> torch.Tensor:
        """An activation as it crosses between pipeline stages: floating ones in ``param_dtype``
        (what the cost model prices), differentiably, so its gradient comes back the same."""
        return t.to(self.param_dtype) if t.is_floating_point() else t

    def held_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter or activation captured as ``dtype`` has under this policy."""
        return self.param_dtype if dtype.is_floating_point else dtype

    def describe(self) -> str:
        if not self.mixed:
            return self.precision
        return (f"{self.precision}: {compute_dtype(self.precision)} parameters and compute, fp32 master weights "
                f"and optimizer state, gradients reduced in {self.reduce}"
                + (", dynamic loss scaling" if self.loss_scaling else ""))


FP32 = PrecisionPolicy()
