"""The one micro-batch loop: a step's forwards and backwards in the order a rank's stage gives them.

A ``Stage`` is what the loop drives: a pipeline stage (runtime/pipeline/stage.py, through
runtime/step/stages.py ``Pipelined``), or a rank without a pipeline, run as a schedule of one
stage (``OneStage`` there: forward then backward per micro-batch). The gradient sync
(runtime/step/sync.py) is told where each forward and backward starts, so data parallelism and
ZeRO run the same under both. ``train_micro_batches`` is a training step's loop, ``forward_micro_batches``
an evaluation's.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from partita.runtime.step.sync import GradientSync
from partita.runtime.trace import TraceRecorder

Order = list[tuple[str, int, int]]  # ("F" | "B", micro-batch, virtual stage), as schedule_order gives them


class Stage(Protocol):
    """A rank's part of the schedule (module docstring)."""

    trace: TraceRecorder
    device: torch.device

    def schedule(self, micro_batches: int, *, training: bool) -> Order:
        """This rank's actions for a step of ``micro_batches``, in order (forwards alone unless ``training``)."""

    def forward_micro(self, k: int, inputs: list[torch.Tensor | None], *, grad: bool = True,
                      chunk: int | None = None) -> Any:
        """Micro-batch ``k``'s forward (``inputs``: its rows of the step's fields, targets last); its
        loss where this rank computes it, else None."""

    def backward_micro(self, k: int, scale: float, chunk: int | None = None) -> None:
        """Micro-batch ``k``'s backward, from its loss times ``scale`` (or the next stage's gradients)."""

    def end_schedule(self, *, training: bool) -> None:
        """After the rank's last action (a pipeline sums tied gradients and lets go of its sends)."""

    def start_mean(self, loss_sum: torch.Tensor, micro_batches: int) -> None:
        """Every forward of the step has run: the mean over "dp" may start (it overlaps the last backward)."""

    def mean(self, loss_sum: torch.Tensor, micro_batches: int) -> float:
        """The step's mean loss over the global batch, the same float on every rank."""


def train_micro_batches(stage: Stage, sync: GradientSync, fields: list[torch.Tensor | None], *,
                        micro_batches: int, size: int, loss_scale: float) -> float:
    """One training step's forwards and backwards over this rank's share ``fields`` (the inputs, then
    the targets), gradients left for the optimizer step; returns the global mean loss. Each rank's
    backward is of its loss times ``loss_scale / micro_batches``, so the sync's mean over "dp" makes
    the gradient that of the mean loss over the global batch."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=stage.device)
    order = stage.schedule(micro_batches, training=True)
    backwards = sum(action == "B" for action, _, _ in order)
    for action, k, chunk in order:
        if action == "F":
            sync.begin_forward()
            loss = stage.forward_micro(k, micro_rows(fields, k, size), chunk=chunk)
            if loss is not None:
                loss_sum += loss.detach().float()
            continue
        backwards -= 1  # the rank's last backward synchronises (the buckets it missed: ``finish``)
        if backwards == 0:
            stage.start_mean(loss_sum, micro_batches)
        sync.begin_backward(backwards == 0)
        stage.backward_micro(k, loss_scale / micro_batches, chunk=chunk)
        sync.after_backward()
    sync.finish()
    stage.end_schedule(training=True)
    stage.trace.step += 1
    return stage.mean(loss_sum, micro_batches)


def forward_micro_batches(stage: Stage, sync: GradientSync, fields: list[torch.Tensor | None], *,
                          micro_batches: int, size: int) -> float:
    """The global mean loss of this rank's share without gradients (the caller turns them off): every
    micro-batch's forward, no backward, so no schedule beyond the forwards' order."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=stage.device)
    for _, k, chunk in stage.schedule(micro_batches, training=False):
        sync.begin_forward()
        loss = stage.forward_micro(k, micro_rows(fields, k, size), grad=False, chunk=chunk)
        if loss is not None:
            loss_sum += loss.float()
    stage.end_schedule(training=False)
    stage.start_mean(loss_sum, micro_batches)
    return stage.mean(loss_sum, micro_batches)


def micro_rows(fields: list[torch.Tensor | None], k: int, size: int) -> list[torch.Tensor | None]:
    """Micro-batch ``k``'s rows of each field (None for one this rank does not read)."""
    return [None if f is None else f[k * size:(k + 1) * size] for f in fields]
