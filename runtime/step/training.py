"""A rank's training step and evaluation, as ``ParallelModel`` runs them: the batch checked and shared
out (runtime/batches.py), the one micro-batch loop over the rank's stage (runtime/step/schedule.py,
runtime/step/stages.py) with the program's gradient sync (runtime/step/sync.py), the optimizer step
(runtime/step/optimizer.py), the policy for a loss that is not finite, the running statistics and the
replica check (runtime/rng.py).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from partita.core.errors import PartitaError, PlanError
from partita.core.options import Options
from partita.core.placement import is_shard
from partita.runtime.batches import check_batch, check_same_batch, share, tokens_per_sample
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.metrics import StepResult
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.program import Program
from partita.runtime.rng import replica_divergence
from partita.runtime.step.optimizer import OptimizerStep
from partita.runtime.step.schedule import forward_micro_batches, train_micro_batches
from partita.runtime.step.stages import stage_of


class Trainer:
    """One rank's steps: ``train_step``, ``evaluate``, and what they measured."""

    def __init__(self, program: Program, options: Options, counter: CollectiveCounter) -> None:
        self.program, self.plan, self.counter = program, program.plan, counter
        self.stage = stage_of(program, counter)  # the pipeline's stage, or the whole rank as one
        self.trace = self.stage.trace
        self.optimizer_step = OptimizerStep(program)
        self.step = 0  # optimizer steps completed (a checkpoint's load sets it)
        # a step whose loss is NaN or infinite: "stop" (raise, the parameters as before it) or "skip"
        self.nonfinite = options.nonfinite or "stop"
        self.nonfinite_skipped = 0  # steps left out for a loss that was not finite ("skip")
        self.batch_check_every = options.batch_check_every or 100
        # every N steps, replicated parameters compared across their groups (0: never; runtime/rng.py)
        self.check_replicas_every = options.check_replicas_every or 0
        self.trace_path = options.trace  # PARTITA_TRACE: the trace written after every step

    def train_step(self, inputs: tuple[Any, ...], targets: Any, *, local: bool) -> StepResult:
        """``ParallelModel.train_step``: one optimizer step over the global batch."""
        p, tr = self.program, self.plan.training
        if tr.inference:
            raise PlanError("this is an inference plan (optimizer \"none\"): call the model, not train_step",
                            hint="compile a training plan to train")
        check_batch(p, inputs, targets, local=local, caller="train_step")
        if not local and p.ctx.world_size > 1 and self.step % self.batch_check_every == 0:
            check_same_batch(p, [*inputs, targets], self.counter, step=self.step, caller="train_step")
        t0 = time.perf_counter()
        fields = self._share(inputs, targets, local)
        self.counter.reset()
        with FLIGHT.running():  # the watchdog (runtime/processes/watchdog.py) bounds every wait inside
            mean = train_micro_batches(self.stage, p.sync, fields, micro_batches=tr.grad_accum_steps,
                                       size=tr.micro_batch_size, loss_scale=self.optimizer_step.loss_scale)
            self._optimizer_step(skip=not self._finite(mean))
            self.step += 1
            p.sync.sync_buffers()  # batch norm's running statistics, the same on every replica
            seconds = time.perf_counter() - t0
            if self.check_replicas_every and self.step % self.check_replicas_every == 0:
                self.check_replicas()
        return StepResult(mean, step=self.step, grad_norm=self.optimizer_step.grad_norm, seconds=seconds,
                          samples=tr.global_batch, tokens_per_sample=tokens_per_sample(p, inputs, targets),
                          lr=self.optimizer_step.lr)

    def evaluate(self, inputs: tuple[Any, ...], targets: Any, *, local: bool, training: bool) -> float:
        """``ParallelModel.evaluate``: the mean loss over the global batch, without gradients;
        ``training``: the model's mode (a forward in train mode updates running statistics)."""
        p, tr = self.program, self.plan.training
        if tr.inference:
            raise PlanError("this is an inference plan (optimizer \"none\"): its graph has no loss to evaluate",
                            hint="call the model for its outputs and apply the loss yourself, or compile a "
                            "training plan")
        check_batch(p, inputs, targets, local=local, caller="evaluate")
        fields = self._share(inputs, targets, local)
        self.counter.reset()
        with FLIGHT.running(), torch.no_grad():
            loss = forward_micro_batches(self.stage, p.sync, fields, micro_batches=tr.grad_accum_steps,
                                         size=tr.micro_batch_size)
            if training:
                p.sync.sync_buffers()  # as PyTorch's train-mode forward, it updated the running statistics
        return loss

    def _share(self, inputs: tuple[Any, ...], targets: Any, local: bool) -> list[torch.Tensor | None]:
        """This rank's share of each input, then of the targets."""
        return [*(share(self.program, x, local=local) for x in inputs), share(self.program, targets, local=local)]

    def _optimizer_step(self, *, skip: bool) -> None:
        self.optimizer_step(skip=skip)
        if self.trace_path:
            self.trace.write(self.trace_path, self.plan)

    def _finite(self, loss: float) -> bool:
        """Whether the step's mean loss is finite; if not, the ``nonfinite`` policy: "stop" raises
        (the gradients dropped, the parameters as before the step), "skip" says so in one line and
        the step changes nothing."""
        if math.isfinite(loss):
            return True
        if self.nonfinite == "stop":
            self._optimizer_step(skip=True)  # drops the gradients: the model stays usable
            raise PartitaError(f"step {self.step}: the loss is {loss} (not finite); the parameters are left as "
                               "they were before this step", hint="look for NaN or inf in the batch, or lower the "
                               "learning rate; nonfinite='skip' (PARTITA_NONFINITE=skip, `partita run --nonfinite "
                               "skip`) leaves such steps out instead")
        self.nonfinite_skipped += 1
        if self.program.ctx.rank == 0:
            print(f"partita: step {self.step} skipped: the loss is {loss} (not finite); the parameters are "
                  f"unchanged ({self.nonfinite_skipped} skipped so far, nonfinite='skip')", flush=True)
        return False

    def check_replicas(self) -> None:
        """``ParallelModel.check_replicas``: raise naming the first replicated parameter whose copies differ."""
        p, tp = self.program, self.program.tp_module
        local = p.local_parameters()
        checks = []
        if tp is not None and self.plan.mesh.tp > 1:
            checks.append(("tp", tp.tp.group, [(n, q) for n, (q, pl) in local.items() if not is_shard(pl)]))
        checks += p.sync.replicas([(n, q) for n, (q, _) in local.items()])  # over "dp", where it keeps copies
        for axis, group, named in checks:
            bad = replica_divergence(named, group, p.ctx.device)
            if bad is not None:
                name, ranks = bad
                raise PartitaError(
                    f"parameter {name} differs on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                    f"from the first rank of its {axis} group after step {self.step}, though the plan replicates it "
                    "there", hint="a bug in partita or a rank that changed its copy outside train_step; "
                    "report it with this message")
