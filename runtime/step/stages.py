"""The stages the micro-batch loop (runtime/step/schedule.py) drives: ``OneStage``, a rank without a
pipeline run as a schedule of one stage, and ``Pipelined``, this rank's pipeline stage
(runtime/pipeline/stage.py) over its dp group. ``stage_of`` picks the one a program runs. Each also
answers the model's call (``ParallelModel.forward``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.core.errors import PartitaError
from partita.core.mesh import MeshAxis
from partita.core.schedule import BACKWARD, FORWARD, ONE_F_ONE_B
from partita.runtime.batches import check_batch, share
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.pipeline.stage import schedule_order
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.program import Program
from partita.runtime.step.schedule import Order
from partita.runtime.trace import TraceRecorder


class OneStage:
    """A rank without a pipeline: 1F1B over a pipeline of one stage, which is forward then backward per
    micro-batch, gradients accumulated over them. The loss is the program's (``Program.loss``), read at
    each call; the mean loss's all-reduce over "dp" runs while the last backward does."""

    def __init__(self, program: Program, counter: CollectiveCounter) -> None:
        self.program, self.counter = program, counter
        self.device = program.ctx.device
        self.trace = TraceRecorder(program.ctx.rank, 0)
        self._inflight: dict[int, torch.Tensor] = {}  # micro-batch -> its loss, until its backward
        self._mean: dist.Work | None = None  # the mean loss's all-reduce, in flight

    def schedule(self, micro_batches: int, *, training: bool) -> Order:
        return schedule_order(ONE_F_ONE_B, 1, 0, micro_batches, inference=not training)

    def forward_micro(self, k: int, inputs: list[torch.Tensor | None], *, grad: bool = True,
                      chunk: int | None = None) -> torch.Tensor:
        if not grad:  # an evaluation's forwards are not traced
            return self.program.loss(inputs[:-1], inputs[-1])
        with self.trace.span(FORWARD, k):
            loss = self.program.loss(inputs[:-1], inputs[-1])
        self._inflight[k] = loss
        return loss

    def backward_micro(self, k: int, scale: float, chunk: int | None = None) -> None:
        loss = self._inflight.pop(k)
        with self.trace.span(BACKWARD, k):
            (loss * scale).backward()

    def end_schedule(self, *, training: bool) -> None:
        pass

    def start_mean(self, loss_sum: torch.Tensor, micro_batches: int) -> None:
        p = self.program
        if p.dp_group is None:
            return
        loss_sum.div_(micro_batches * p.dp_size)
        self._mean = dist.all_reduce(loss_sum, group=p.dp_group, async_op=True)
        self.counter.record("all_reduce", MeshAxis.DP.value, loss_sum.element_size())

    def mean(self, loss_sum: torch.Tensor, micro_batches: int) -> float:
        work, self._mean = self._mean, None
        if work is not None:
            work.wait()
        else:
            loss_sum.div_(micro_batches)
        return float(loss_sum)

    def call(self, args: tuple, kwargs: dict) -> Any:
        """The wrapped module's call."""
        return self.program.module(*args, **kwargs)


class Pipelined:
    """This rank's pipeline stage, whose schedule is the plan's (runtime/pipeline/stage.py); the step's
    mean loss is the last stage's, averaged over "dp" and broadcast over "pp"."""

    def __init__(self, program: Program, counter: CollectiveCounter) -> None:
        self.program, self.counter = program, counter
        self.pipeline = program.pipeline
        self.device, self.trace = self.pipeline.device, self.pipeline.trace

    def schedule(self, micro_batches: int, *, training: bool) -> Order:
        return self.pipeline.schedule(micro_batches, training=training)

    def forward_micro(self, k: int, inputs: list[torch.Tensor | None], *, grad: bool = True,
                      chunk: int | None = None) -> Any:
        return self.pipeline.forward_micro(k, inputs, grad=grad, chunk=chunk)

    def backward_micro(self, k: int, scale: float, chunk: int | None = None) -> None:
        self.pipeline.backward_micro(k, scale, chunk=chunk)

    def end_schedule(self, *, training: bool) -> None:
        self.pipeline.end_schedule(training=training)

    def start_mean(self, loss_sum: torch.Tensor, micro_batches: int) -> None:
        pass  # the last stage's losses are shared once the schedule has ended

    def mean(self, loss_sum: torch.Tensor, micro_batches: int) -> float:
        return self.pipeline.mean(loss_sum, micro_batches, self.program.dp_group)

    def call(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The inputs (this rank's share of the global batch, as ``train_step`` takes it) streamed
        through the stages: the whole batch's output, on every rank."""
        local = kwargs.pop("local", False)
        if kwargs:
            raise PartitaError(f"a pipeline model takes its inputs positionally; got {sorted(kwargs)}",
                               hint="call model(x, ...) with the planned inputs in order")
        p = self.program
        check_batch(p, args, None, local=local, caller="the model", with_targets=False)
        xs = [share(p, x, local=local) for x in args]
        self.counter.reset()
        with FLIGHT.running():
            return self.pipeline.infer(xs, p.dp_group)


def stage_of(program: Program, counter: CollectiveCounter) -> OneStage | Pipelined:
    """What runs ``program``'s micro-batches: its pipeline stage, or the whole rank as one stage."""
    return Pipelined(program, counter) if program.pipeline is not None else OneStage(program, counter)
