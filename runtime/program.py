"""``Program``: what compose (runtime/compose.py) built for this rank, as one record.

The training step (runtime/step/), the gradient norm (runtime/grad_norm.py),
checkpoints (runtime/state/sharded.py) and the full state dict
(runtime/state/full.py) read a rank's parts from here, never from one another:
this file sits below all of them, so none of them imports the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from partita.core.mesh import sequence_chunks
from partita.core.plans.plan import Plan
from partita.core.precision import FP32, PrecisionPolicy
from partita.runtime.distributed import DistContext
from partita.runtime.dp.averaging import Averagers, GradientAverager
from partita.runtime.dp.zero import ZeroProgram
from partita.runtime.mixed_precision import LossScaler, MasterWeights
from partita.runtime.pipeline.stage import PipelineStage
from partita.runtime.step.sync import GradientSync
from partita.runtime.tp.module import TensorParallel

MicroBatchLoss = Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]


def tp_module_of(local: nn.Module, pipeline: PipelineStage | None) -> TensorParallel | None:
    """The TP program a rank runs: its pipeline stage's, or ``local`` itself when it is one; None
    when the eager module runs."""
    if pipeline is not None:
        return pipeline.tp
    return local if isinstance(local, TensorParallel) else None


@dataclass
class Program:
    """This rank's parts of a plan: its module, how a micro-batch's loss is computed, the
    gradient reduction and the one optimizer (and the gradient sync over them)."""

    plan: Plan
    ctx: DistContext
    module: nn.Module  # the eager module, the TP program, or the pipeline stage
    loss: MicroBatchLoss | None  # one micro-batch's loss (pp == 1; a pipeline's schedule runs its own)
    optimizer: Optimizer | None  # None for an inference plan: the user's, on the masters (runtime/mixed_precision.py)
    # gradients averaged over "dp" (without ZeRO; the tied ones with it), the experts' over "edp"
    averager: GradientAverager | Averagers | None = None
    zero: ZeroProgram | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    dp_size: int = 1
    pipeline: PipelineStage | None = None  # pp > 1: this rank's stage, which runs the schedule
    master: MasterWeights | None = None  # without ZeRO: what the optimizer updates (ZeRO has its own)
    policy: PrecisionPolicy = FP32
    scaler: LossScaler = field(default_factory=lambda: LossScaler(FP32))  # fp16's dynamic loss scale, else 1
    # the unwrapped model's state_dict names (tied names too) and persistent buffers, read
    # before the plan's parts took the module apart: checkpoints are in those names
    state_names: dict[str, list[str]] = field(default_factory=dict)
    persistent: set[str] = field(default_factory=set)
    # how the gradients become the step's and the optimizer steps on them (runtime/step/sync.py)
    sync: GradientSync = field(default_factory=GradientSync)
    scheduler: Any = None  # the user's LR scheduler over the one optimizer (ZeRO's: over its shards, alike)
    norm_terms: Any = None  # what the gradient norm reads, worked out at its first step (runtime/grad_norm.py)

    @property
    def cp(self) -> int:
        """The dp ranks sharing each sample, each holding a slice of its sequence (core/mesh.py ``Mesh.cp``)."""
        return self.plan.mesh.cp if self.dp_size > 1 else 1

    @property
    def samples(self) -> int:
        """The groups each global batch's rows are split over (dp / cp)."""
        return self.dp_size // self.cp

    @property
    def sample_rank(self) -> int:
        """This rank's group of rows: the rows ``[sample_rank * b, (sample_rank + 1) * b)``, b = global / samples."""
        return self.dp_rank // self.cp

    def sequence_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of each sequence in ``t`` (dim 1): its two chunks (core/mesh.py
        ``sequence_chunks``), taken as two slices, with no index built per step."""
        if self.cp == 1 or t.dim() < 2:
            return t
        size = t.shape[1] // (2 * self.cp)
        return torch.cat([t.narrow(1, c * size, size) for c in sequence_chunks(self.cp, self.dp_rank % self.cp)], 1)

    @property
    def updates(self) -> MasterWeights | None:
        """The one optimizer's masters: ZeRO's (its shards and the parameters it was given) or the plain one."""
        return self.zero.master if self.zero is not None else self.master

    @property
    def tp_module(self) -> TensorParallel | None:
        """This rank's TP program (its stage's, in a pipeline); None on the eager path."""
        return tp_module_of(self.module, self.pipeline)

    def local_parameters(self) -> dict[str, tuple[nn.Parameter, str]]:
        """Qualified name -> (this rank's tensor of the parameter, its tp placement)."""
        tp = self.tp_module
        if tp is not None:
            return tp.local_parameters()
        return {n: (q, "replicate") for n, q in self.module.named_parameters()}

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers that are part of the model's state_dict, by name."""
        tp = self.tp_module
        if tp is None:
            return {k: b for k, b in self.module.named_buffers() if k in self.persistent}
        return {tp.buffer_nodes[n]: b for n, b in tp.buffers_by_node().items()
                if tp.buffer_nodes[n] in self.persistent}
