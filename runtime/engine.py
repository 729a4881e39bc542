"""Runs a plan: one ``ParallelModel`` per rank, whose ``train_step`` is the user's loop.

``ParallelModel`` composes a rank's parts, each behind its own small interface: ``compose``
(runtime/compose.py) applies the plan's parts to the user's module in one stated order and
returns this rank's ``Program`` (runtime/program.py); the ``Trainer`` (runtime/step/training.py)
runs its steps: the one micro-batch loop over the rank's stage, the gradient sync, the optimizer
step; ``Checkpoints`` (runtime/state/checkpoints.py) saves, loads and resumes; ``StepReport``
(runtime/metrics.py) says what each step did. docs/runtime.md, "A training step".

Tracing: ``ParallelModel.write_trace(path)`` (collective: every rank calls it)
gathers each rank's per-micro-batch forward / backward spans to rank 0, which
writes a Chrome/Perfetto trace (runtime/trace.py). With ``PARTITA_TRACE=path``
in the environment, ``train_step`` does so after every step, so the file holds
all steps so far when the run ends.
"""

from __future__ import annotations

from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partita.core.options import Options
from partita.core.plans.plan import Plan
from partita.runtime.batches import field_names, fields_read, stage_reads
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.compose import compose
from partita.runtime.data import share_loader
from partita.runtime.distributed import DistContext, init_distributed
from partita.runtime.metrics import StepReport, StepResult
from partita.runtime.processes.watchdog import watch
from partita.runtime.state import full as full_state
from partita.runtime.state.checkpoints import Checkpoints
from partita.runtime.step.training import Trainer

__all__ = ["ParallelModel", "StepResult", "apply_plan"]


def _of_part(path: str, doc: str, *, settable: bool = False) -> property:
    """An attribute of the model that is one of its parts' (``path``, dotted from the model), read through."""
    owner, _, name = path.rpartition(".")
    put = (lambda self, value: setattr(attrgetter(owner)(self), name, value)) if settable else None
    return property(attrgetter(path), put, doc=doc)


class ParallelModel(nn.Module):
    """The user's module, run as the plan says; ``train_step`` is the whole training step.

    Calling it, and attribute access, fall through to the wrapped module; a
    backward run outside ``train_step`` accumulates gradients locally and does
    not average them.
    Parameters are broadcast from dp rank 0 at construction: ranks that built
    the model under different seeds would otherwise train different replicas
    and silently diverge, since averaged gradients cannot bring them together.
    """

    step = _of_part("_trainer.step", "Optimizer steps completed (restored by ``load_checkpoint``): a loop "
                    "``while model.step < N: model.train_step(...)`` resumes where it stopped.")
    grad_norm = _of_part("_trainer.optimizer_step.grad_norm", "The last step's global gradient norm (before clipping).")
    skipped_steps = _of_part("_trainer.optimizer_step.skipped_steps",
                             "fp16: steps skipped for an inf or nan gradient (the loss scale halved).")
    _loss_scale = _of_part("_trainer.optimizer_step.loss_scale", "What the loss is multiplied by before backward.")
    nonfinite_skipped = _of_part("_trainer.nonfinite_skipped", "Steps left out for a loss that was not finite.")
    trace = _of_part("_trainer.trace", "This rank's micro-batch spans of every step so far (``write_trace``).")
    metrics_log = _of_part("_report.metrics_log", "Rank 0's TensorBoard / wandb log (runtime/metrics.py), or None.")
    checkpoint_dir = _of_part("_checkpoints.root", "Where periodic checkpoints are written and resumed from.")
    resumed_from = _of_part("_checkpoints.resumed_from", "The checkpoint this run resumed from, or None.")
    extra = _of_part("_checkpoints.extra", "Saved with every periodic checkpoint, restored on resume (e.g. the "
                     "data position).", settable=True)
    rank = _of_part("ctx.rank", "This process's rank in the job (0 outside torchrun): print and save on rank 0.")
    world_size = _of_part("ctx.world_size", "The processes the plan runs on (1 outside torchrun).")
    tensor_parallel = _of_part("_program.tp_module", "This rank's TP program (its stage's, in a pipeline; also "
                               "at tp = 1 there or when the plan recomputes); None when the eager module runs.")

    def __init__(self, module: nn.Module, plan: Plan, options: Options | None = None, *,
                 ctx: DistContext | None = None) -> None:
        super().__init__()
        # the run options left unset come from the environment `partita run` sets (core/options.py)
        self.options = options = (options if options is not None else Options()).with_environment()
        self.ctx = ctx if ctx is not None else init_distributed(watchdog_s=options.watchdog_s)
        # before any collective: a hang from here on ends with one message (runtime/processes/watchdog.py)
        watch(rank=self.ctx.rank, world_size=self.ctx.world_size, mesh=plan.mesh, timeout_s=options.watchdog_s)
        self.plan, self.loss_fn = plan, options.loss
        self.collectives = CollectiveCounter()  # calls issued by the last train_step
        self._program = program = compose(module, plan, self.ctx, options, self.collectives)
        self.module, self.optimizer, self.scheduler = program.module, program.optimizer, program.scheduler
        self._trainer = Trainer(program, options, self.collectives)  # its steps
        self._report = StepReport(plan, self.ctx.rank, self.ctx.device, options)  # what each step says
        self._checkpoints = Checkpoints(program, options)
        self._trainer.step = self._checkpoints.resume()  # from checkpoint_dir's newest intact one, if any

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's call; on a pipeline plan, the inputs (this rank's share of the
        global batch, as ``train_step`` takes it) streamed through the stages: the whole
        batch's output, on every rank."""
        return self._trainer.stage.call(args, kwargs)

    def train_step(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None, local: bool = False) -> StepResult:
        """One optimizer step over the global batch; returns its mean loss (equal on every rank), a
        float that also carries the step's gradient norm, time and throughput (``StepResult``).

        By default every rank passes the same global batch and takes its dp
        slice; with ``local=True`` each passes only its own share. The share is
        run as ``grad_accum_steps`` micro-batches of ``micro_batch_size``; the
        gradient is that of the mean loss over the global batch.
        """
        result = self._trainer.train_step(inputs, targets, local=local)
        self._report(result, skipped_steps=self.skipped_steps)
        self._checkpoints.save_if_due(self.step)  # unwatched: a large checkpoint may take longer than the limit
        return result

    def evaluate(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None, local: bool = False) -> float:
        """The mean loss over the global batch, without gradients or an optimizer step, on any
        training plan (TP, PP, ZeRO and their meshes alike); a collective: every rank calls it and
        gets the same float. Inputs as ``train_step`` takes them. The forward follows the module's
        mode, as PyTorch's does: after ``model.eval()`` dropout is off and batch norm uses its
        running statistics, which it leaves alone."""
        return self._trainer.evaluate(inputs, targets, local=local, training=self.training)

    def loader(self, dataset: Any, **dataloader_kwargs: Any) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` of this rank's share of each global batch, for ``train_step(...,
        local=True)``: ``for x, y in model.loader(ds): model.train_step(x, targets=y, local=True)``.
        ``shuffle=True`` / ``seed=`` draw the order alike on every rank. On a pipeline, a field
        this rank's stage does not read (``reads``) comes as None, unfetched where it can be:
        ``dataset`` may be one dataset of (inputs..., targets) samples or a tuple of one dataset
        per field (runtime/data.py)."""
        p = self._program
        return share_loader(p, dataset, reads=stage_reads(p), fields=len(field_names(p)), **dataloader_kwargs)

    @property
    def reads(self) -> tuple[str, ...]:
        """The step's fields this rank reads: the planned inputs' names and "targets", all of
        them but on a pipeline, where the first stage reads the inputs and the last the targets
        (as the plan places them); with ``local=True`` the others may be passed as None."""
        return fields_read(self._program)

    def full_state_dict(self, *, buffers: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter at full shape on every rank, however the plan spread them, and the
        persistent buffers unless ``buffers=False`` (a collective: call it on every rank).
        runtime/state/full.py says how."""
        return full_state.full_state_dict(self._program, buffers=buffers)

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers that are part of the model's state_dict, by name."""
        return self._program.persistent_buffers()

    def check_replicas(self) -> None:
        """Raise ``PartitaError`` naming the first parameter that the plan replicates and whose
        copies differ: over "tp" (parameters not sharded there) and, without ZeRO, over "dp". A
        collective: every rank calls it (``check_replicas_every=N`` does, every N steps)."""
        self._trainer.check_replicas()

    def save_checkpoint(self, path: str | Path, *, extra: dict | None = None, async_save: bool = False) -> Any:
        """Save this run's state to directory ``path`` with torch.distributed.checkpoint, each rank
        writing only what it holds (a collective: call it on every rank). ``extra`` (plain Python
        values, e.g. the data position) comes back from ``load_checkpoint``. With ``async_save``
        the write goes on in the background: wait on the returned future before relying on it."""
        return self._checkpoints.save(path, step=self.step, extra=extra, async_save=async_save)

    def load_checkpoint(self, path: str | Path, *, optimizer: str = "restore", partial: bool = False) -> dict:
        """Restore the state saved in ``path`` (under this plan or any other: DCP reshards), in
        place; returns the saved ``extra``. A collective: call it on every rank.

        The checkpoint must be of this model (the same tensors: names, shapes, dtypes) and this
        optimizer (its class and hyperparameters), else nothing is loaded and one
        ``CheckpointError`` names the first difference; so does a damaged file. Asked explicitly,
        ``partial=True`` loads the tensors both hold and leaves the rest; ``optimizer="state"``
        loads the optimizer's state but keeps this run's hyperparameters, ``optimizer="skip"``
        loads no optimizer state (another optimizer's checkpoint, say). The LR scheduler's state is
        restored with the hyperparameters (``optimizer="restore"``)."""
        self._trainer.step, extra = self._checkpoints.load(path, optimizer=optimizer, partial=partial)
        return extra

    def wait_for_checkpoint(self) -> None:
        """Wait until the periodic checkpoint being written in the background is complete (its
        marker written); a failed write is raised here as one ``CheckpointError``."""
        self._checkpoints.wait()

    def write_trace(self, path: str | Path) -> Path | None:
        """Write the micro-batch timings of every step so far as a Chrome/Perfetto trace.

        Collective: every rank calls it; rank 0 writes ``path`` (and returns it)."""
        return self.trace.write(path, self.plan)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def apply_plan(module: nn.Module, plan: Plan, options: Options | None = None, *,
               ctx: DistContext | None = None) -> ParallelModel:
    """Wrap ``module`` to run ``plan`` on this rank (the parts are applied by ``compose``), as
    ``options`` say (core/options.py): the loss and the optimizer factory; ``weights`` (a
    ``torch.save``d state dict or a .safetensors file: under tensor parallelism each rank reads
    only its slices, so ``module`` may be built on the meta device); ``checkpoint_dir`` /
    ``checkpoint_every`` (a sharded checkpoint every N steps there, and resuming from the newest
    intact one found at construction: runtime/state/periodic.py); ``watchdog_s`` (how long a
    step may wait: runtime/processes/watchdog.py, default 300 s, 0 off)."""
    return ParallelModel(module, plan, options, ctx=ctx)
