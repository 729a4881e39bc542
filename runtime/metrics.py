"""What a training step reports (``StepResult``), and where it is written (``StepReport``: rank 0's
progress line and ``MetricsLog``).

``ParallelModel.train_step`` returns a ``StepResult``; with ``log_dir=`` rank 0 also writes
each step's figures as TensorBoard scalars (``torch.utils.tensorboard``, which needs the
``tensorboard`` package, imported only then), and with ``wandb_project=`` logs them to that
Weights & Biases project (``wandb``, imported only then). The figures are those the step
already has: no extra synchronisation, no device-to-host copy beyond the loss the step reads
anyway.
"""

from __future__ import annotations

import atexit
import weakref
from pathlib import Path

import torch

from partita.core.errors import PartitaError
from partita.core.options import Options
from partita.core.plans.plan import Plan


class StepResult(float):
    """``train_step``'s mean loss (a float, as before), with what else the step measured:
    ``grad_norm`` (the global gradient norm, before clipping), ``seconds`` (wall time of the step
    on this rank), ``samples_per_s``, for token inputs ``tokens_per_s``, and ``lr`` (the learning
    rate this step's update used, before the scheduler stepped); ``step`` is ``model.step``
    after it."""

    step: int
    grad_norm: float
    seconds: float
    samples_per_s: float
    tokens_per_s: float | None
    lr: float

    def __new__(cls, loss: float, *, step: int, grad_norm: float, seconds: float, samples: int,
                tokens_per_sample: int | None, lr: float = float("nan")) -> StepResult:
        self = super().__new__(cls, loss)
        self.step, self.grad_norm, self.seconds, self.lr = step, grad_norm, seconds, lr
        self.samples_per_s = samples / seconds if seconds > 0 else float("inf")
        self.tokens_per_s = self.samples_per_s * tokens_per_sample if tokens_per_sample else None
        return self

    @property
    def loss(self) -> float:
        return float(self)


class StepReport:
    """Rank 0's account of each step (nothing elsewhere): the plan once, then a progress line every
    ``log_every`` steps, measured next to predicted (``log_every=0`` / ``PARTITA_LOG_EVERY=0``:
    silent), and with ``log_dir`` or ``wandb_project`` the step's figures in the ``metrics_log``. A
    step is named by its index from 0, as a user's loop and the metrics log count it."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, options: Options) -> None:
        self.plan, self.rank = plan, rank
        self.log_every = options.log_every if options.log_every is not None else 10
        self.metrics_log = MetricsLog(plan, device, log_dir=options.log_dir, wandb_project=options.wandb_project) \
            if (options.log_dir is not None or options.wandb_project) and rank == 0 else None

    def __call__(self, result: StepResult, *, skipped_steps: int = 0) -> None:
        """Report ``result``; ``skipped_steps``: fp16's steps skipped so far, said when there are any."""
        self._print(result, skipped_steps)
        if self.metrics_log is not None:
            self.metrics_log.write(result)

    def _print(self, result: StepResult, skipped_steps: int) -> None:
        if self.rank != 0 or not self.log_every:
            return
        pred = self.plan.predicted
        if result.step == 1:
            t = self.plan.training
            print(f"partita: plan {self.plan.mesh}, {t.precision}, ZeRO-{t.zero_stage}, {t.grad_accum_steps} "
                  f"micro-batch(es) of {t.micro_batch_size}"
                  + (f", {t.schedule}" if self.plan.mesh.pp > 1 else "")
                  + f"; predicted {pred.step_time_s * 1e3:.0f} ms/step", flush=True)
        if result.step % self.log_every == 0:
            rate = (f", {result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s is not None
                    else f", {result.samples_per_s:,.1f} samples/s")
            print(f"partita: step {result.step - 1} loss {float(result):.4f} grad norm {result.grad_norm:.3g} "
                  f"{result.seconds * 1e3:.0f} ms/step (predicted {pred.step_time_s * 1e3:.0f}){rate}"
                  + (f", {skipped_steps} skipped (fp16 overflow)" if skipped_steps else ""), flush=True)


class MetricsLog:
    """Rank 0's metrics: TensorBoard event files under ``log_dir`` and / or a Weights & Biases
    run in ``wandb_project``. Per step ``loss``, ``grad_norm``, ``lr``, ``tokens_per_s``
    (``samples_per_s`` for other inputs), ``mfu`` (the plan's predicted MFU scaled by predicted
    over measured step time: the model's FLOPs against the planned cluster's peak) and, on CUDA,
    ``peak_memory_bytes`` (the allocator's high-water mark). The wandb run's config is the plan's
    mesh, schedule and predictions.

    Each step is logged at its index counted from 0, as a user's ``for step in range(n)`` loop
    counts: ``model.step`` before the step (``StepResult.step - 1``), so a resumed run goes on
    at the index it stopped at. Events are flushed every 10 seconds and at exit (``close``)."""

    def __init__(self, plan: Plan, device: torch.device, *, log_dir: str | Path | None = None,
                 wandb_project: str | None = None) -> None:
        self.plan, self.device = plan, device
        self.writer = self.run = None
        if log_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch's writer imports the tensorboard package
                raise PartitaError(f"log_dir={str(log_dir)!r} writes TensorBoard event files, and the tensorboard "
                                   f"package is not installed ({e})", hint="pip install tensorboard "
                                   "(or partita[metrics]), or leave log_dir out") from e
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise PartitaError(f"wandb_project={wandb_project!r} logs to Weights & Biases, and the wandb "
                                   f"package is not installed ({e})",
                                   hint="pip install wandb, or leave wandb_project out") from e
            self.run = wandb.init(project=wandb_project, name=plan.model.name or None, config=run_config(plan),
                                  dir=str(log_dir) if log_dir is not None else None)
        if log_dir is not None:
            try:  # the folder is made here: Options checked its path, the file system has the last word
                self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)
            except OSError as e:
                if self.run is not None:
                    self.run.finish()
                raise PartitaError(f"log_dir={str(log_dir)!r}: cannot write TensorBoard's event files there "
                                   f"({e.strerror or e})", hint="pass a folder you can write to, or leave "
                                   "log_dir out") from None
        atexit.register(_close_at_exit, weakref.ref(self))

    def write(self, result: StepResult) -> None:
        """``result``'s figures at the step's index (the class docstring)."""
        index = result.step - 1
        pred = self.plan.predicted
        scalars = {"loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                   "mfu": pred.mfu * pred.step_time_s / result.seconds if result.seconds > 0 else None}
        if result.tokens_per_s is not None:
            scalars["tokens_per_s"] = result.tokens_per_s
        else:
            scalars["samples_per_s"] = result.samples_per_s
        if self.device.type == "cuda":
            scalars["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.device)
        scalars = {name: value for name, value in scalars.items() if value is not None}
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, index)
        if self.run is not None:
            self.run.log(scalars, step=index)

    def flush(self) -> None:
        """Write the events queued so far to the event file."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def run_config(plan: Plan) -> dict:
    """What a wandb run records of the plan: its mesh, ZeRO stage, batch and schedule, and the
    predictions its figures are measured against."""
    m, tr, pred = plan.mesh, plan.training, plan.predicted
    return {"dp": m.dp, "tp": m.tp, "pp": m.pp, "zero": tr.zero_stage, "precision": tr.precision,
            "global_batch": tr.global_batch, "micro_batch_size": tr.micro_batch_size,
            "grad_accum_steps": tr.grad_accum_steps,
            "schedule": tr.schedule, "predicted_step_time_s": pred.step_time_s, "predicted_mfu": pred.mfu}


def _close_at_exit(ref: weakref.ref) -> None:
    log = ref()
    if log is not None:
        log.close()
