"""The gradient sync: how a rank's gradients become the step's, and how its one optimizer steps on them.

One interface, ``GradientSync``, which the micro-batch loop (runtime/step/schedule.py) and the
optimizer step (runtime/step/optimizer.py) call the same whatever the plan, and one implementation
per way a plan keeps its replicas, chosen once by ``compose`` (runtime/compose.py, its step 4):

- ``GradientSync`` itself: an inference plan's, with no gradients and no optimizer;
- ``OneReplica``: no data parallelism, the rank's gradients are the step's;
- ``Averaged``: data parallelism, gradients averaged over "dp" in buckets overlapped with backward
  (runtime/dp/averaging.py; under expert parallelism the experts' over "edp" beside them);
- ``Sharded``: ZeRO (runtime/dp/zero.py), and the parameters it keeps whole (tied across stages,
  a rank's experts) averaged as ``Averaged`` averages them.

Offloading the optimizer (``MasterWeights(offload=True)``) and mixed precision change what the
optimizer steps, not when gradients move: they live in runtime/mixed_precision.py's masters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.dp.averaging import Averagers, BufferAverager, GradientAverager
from partita.runtime.dp.zero import ZeroProgram
from partita.runtime.mixed_precision import MasterWeights

Named = list[tuple[str, torch.Tensor]]


class GradientSync:
    """The interface, with what a rank that has nothing to synchronise does; the base itself is an
    inference plan's (no optimizer: ``step`` and ``zero_grad`` are never reached).

    Per step the loop calls ``begin_forward`` before each micro-batch's forward, ``begin_backward``
    / ``after_backward`` around each backward (a pipeline interleaves them), ``finish`` after the
    last; then the optimizer step reads ``reduced_grads`` and ``unreached_here``, calls
    ``leave_unreached`` where some rank had a parameter no backward reached, ``step`` (unless the
    step is skipped) and ``zero_grad``."""

    def begin_forward(self) -> None:
        """Before each micro-batch's forward."""

    def begin_backward(self, last: bool) -> None:
        """Before each micro-batch's backward; ``last``: the rank's last of the step, which synchronises."""

    def after_backward(self) -> None:
        """After each micro-batch's backward."""

    def finish(self) -> None:
        """After the step's last backward: every reduction launched and complete."""

    def reduced_grads(self) -> dict[int, torch.Tensor]:
        """A parameter's mean gradient by ``id`` where the reduction kept it out of ``.grad``."""
        return {}

    def unreached_here(self) -> bool:
        """Whether a parameter got no gradient on this rank in this step (``leave_unreached`` asks all)."""
        return False

    def leave_unreached(self, reduced: dict[int, torch.Tensor]) -> list[nn.Parameter]:
        """A collective: the parameters no rank's backward reached keep no gradient, as in one process
        (runtime/dp/buckets.py ``unreached``); returns those ``step`` must leave as they are."""
        return []

    def step(self, inv_scale: float, reduced: Mapping[int, torch.Tensor], frozen: Sequence[nn.Parameter]) -> None:
        """The one optimizer's step on the step's gradients, times ``inv_scale``."""
        raise NotImplementedError("an inference plan has no optimizer to step")

    def zero_grad(self) -> None:
        """After the step (taken or skipped): the gradients dropped."""
        raise NotImplementedError("an inference plan has no gradients to drop")

    def sync_buffers(self) -> None:
        """After a training forward: the running statistics the same on every replica."""

    def replicas(self, local: Named) -> list[tuple[str, dist.ProcessGroup, Named]]:
        """(axis, group, parameters) over which this sync keeps whole copies of ``local`` equal."""
        return []


class OneReplica(GradientSync):
    """No data parallelism: the optimizer steps on this rank's gradients as they are."""

    def __init__(self, master: MasterWeights) -> None:
        self.master = master

    def step(self, inv_scale: float, reduced: Mapping[int, torch.Tensor], frozen: Sequence[nn.Parameter]) -> None:
        self.master.step(inv_scale, reduced)

    def zero_grad(self) -> None:
        self.master.optimizer.zero_grad(set_to_none=True)
        for q in self.master.params:
            q.grad = None


class Averaged(GradientSync):
    """Gradients averaged over "dp" (and the experts' over "edp": ``Averagers``), overlapped with the
    last backward; earlier micro-batches accumulate locally."""

    def __init__(self, averager: GradientAverager | Averagers, master: MasterWeights, buffers: BufferAverager,
                 group: dist.ProcessGroup) -> None:
        self.averager, self.master, self.buffers, self.group = averager, master, buffers, group

    def begin_backward(self, last: bool) -> None:
        self.averager.begin(sync=last)

    def finish(self) -> None:
        self.averager.finish()

    def reduced_grads(self) -> dict[int, torch.Tensor]:
        return self.averager.reduced_grads()

    def unreached_here(self) -> bool:
        return self.averager.unreached_here()

    def leave_unreached(self, reduced: dict[int, torch.Tensor]) -> list[nn.Parameter]:
        unreached = self.averager.unreached()
        for q in unreached:  # the average handed them zeros: the optimizer must not move them
            q.grad = None
            reduced.pop(id(q), None)
        return unreached

    def step(self, inv_scale: float, reduced: Mapping[int, torch.Tensor], frozen: Sequence[nn.Parameter]) -> None:
        self.master.step(inv_scale, reduced)

    def zero_grad(self) -> None:
        self.averager.zero_grad()

    def sync_buffers(self) -> None:
        self.buffers.sync()

    def replicas(self, local: Named) -> list[tuple[str, dist.ProcessGroup, Named]]:
        return [("dp", self.group, local)]


class Sharded(Averaged):
    """ZeRO over "dp" (runtime/dp/zero.py), told where each forward and backward starts; the
    parameters it keeps whole are averaged beside it (``Averagers([])`` when there are none)."""

    def __init__(self, zero: ZeroProgram, averager: GradientAverager | Averagers, buffers: BufferAverager,
                 group: dist.ProcessGroup) -> None:
        super().__init__(averager, zero.master, buffers, group)
        self.zero = zero

    def begin_forward(self) -> None:
        self.zero.begin_forward()  # ZeRO-3 gathers each parameter where it is read, then frees it

    def begin_backward(self, last: bool) -> None:
        super().begin_backward(last)
        self.zero.begin_backward(last)

    def after_backward(self) -> None:
        self.zero.after_backward()

    def unreached_here(self) -> bool:
        return super().unreached_here() or self.zero.reducer.unreached_here()

    def leave_unreached(self, reduced: dict[int, torch.Tensor]) -> list[nn.Parameter]:
        super().leave_unreached(reduced)
        return self.zero.reducer.unreached()  # their slices of the shards stay as they were

    def step(self, inv_scale: float, reduced: Mapping[int, torch.Tensor], frozen: Sequence[nn.Parameter]) -> None:
        self.zero.step(inv_scale, frozen=frozen)  # the optimizer on this rank's shards, then the parameters gathered

    def zero_grad(self) -> None:
        self.zero.zero_grad()
        super().zero_grad()

    def replicas(self, local: Named) -> list[tuple[str, dist.ProcessGroup, Named]]:
        return []  # a rank holds its own shards: nothing whole to compare over "dp"
