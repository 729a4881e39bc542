"""Runs a plan: one ``ParallelModel`` per rank, whose ``train_step`` is the user's loop.

``compose`` (runtime/compose.py) applies the plan's parts to the user's module
in one stated order and returns this rank's ``Program`` (runtime/program.py);
``ParallelModel`` runs it: the micro-batch loop (or the pipeline's schedule),
the gradient norm and clipping (runtime/grad_norm.py), the one optimizer step and the LR
scheduler's, checkpoints (runtime/state/: sharded.py, loading.py, periodic.py) and what a step
reports (``StepResult``, and with ``log_dir`` TensorBoard: runtime/metrics.py).

Tracing: ``ParallelModel.write_trace(path)`` (collective: every rank calls it)
gathers each rank's per-micro-batch forward / backward spans to rank 0, which
writes a Chrome/Perfetto trace (runtime/trace.py). With ``PARTITA_TRACE=path``
in the environment, ``train_step`` does so after every step, so the file holds
all steps so far when the run ends.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.core.errors import PartitaError, PlanError
from partita.core.mesh import MeshAxis
from partita.core.options import Options
from partita.core.placement import is_shard
from partita.core.plan import Plan
from partita.core.schedule import BACKWARD, FORWARD
from partita.runtime.batches import check_batch, check_same_batch, field_names, share, stage_reads, tokens_per_sample
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.compose import compose, user_scheduler
from partita.runtime.data import share_loader
from partita.runtime.distributed import DistContext, init_distributed
from partita.runtime.grad_norm import clip_coefficient, global_grad_norm
from partita.runtime.metrics import MetricsLog, StepResult
from partita.runtime.program import Program
from partita.runtime.rng import replica_divergence
from partita.runtime.state import full as full_state
from partita.runtime.state import loading, periodic
from partita.runtime.state import sharded as sharded_state
from partita.runtime.tp.module import TensorParallel
from partita.runtime.trace import TraceRecorder
from partita.runtime.watchdog import FLIGHT, watch

__all__ = ["ParallelModel", "StepResult", "apply_plan"]


class ParallelModel(nn.Module):
    """The user's module, run as the plan says; ``train_step`` is the whole training step.

    Calling it, and attribute access, fall through to the wrapped module; a
    backward run outside ``train_step`` accumulates gradients locally and does
    not average them.
    Parameters are broadcast from dp rank 0 at construction: ranks that built
    the model under different seeds would otherwise train different replicas
    and silently diverge, since averaged gradients cannot bring them together.
    """

    def __init__(self, module: nn.Module, plan: Plan, options: Options | None = None, *,
                 ctx: DistContext | None = None) -> None:
        super().__init__()
        # the run options left unset come from the environment `partita run` sets (core/options.py)
        options = (options if options is not None else Options()).with_environment()
        self.options = options
        self.ctx = ctx if ctx is not None else init_distributed(watchdog_s=options.watchdog_s)
        # before any collective: a hang from here on ends with one message (runtime/watchdog.py)
        watch(rank=self.ctx.rank, world_size=self.ctx.world_size, mesh=plan.mesh, timeout_s=options.watchdog_s)
        self.plan = plan
        self.loss_fn = options.loss
        self.collectives = CollectiveCounter()  # calls issued by the last train_step
        self._step = 0
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        self.log_every = options.log_every if options.log_every is not None else 10  # rank 0's progress line
        self.skipped_steps = 0  # fp16: steps skipped for an inf or nan gradient (the loss scale halved)
        # a step whose loss is NaN or infinite: "stop" (raise, the parameters as before it) or "skip"
        self.nonfinite = options.nonfinite or "stop"
        self.nonfinite_skipped = 0  # steps left out for a loss that was not finite ("skip")
        self.batch_check_every = options.batch_check_every or 100
        # every N steps, replicated parameters compared across their groups (0: never; runtime/rng.py)
        self.check_replicas_every = options.check_replicas_every or 0
        program = compose(module, plan, self.ctx, options, self.collectives)
        self.module = program.module
        self.optimizer = program.optimizer
        self._program = program
        # the user's LR scheduler over the one optimizer (ZeRO's is over shards: it scales their lr alike)
        self.scheduler = None if options.scheduler is None or self.optimizer is None else user_scheduler(
            options.scheduler, self.optimizer)
        self._lr = float("nan")  # the learning rate the last step's update used
        self.metrics_log = MetricsLog(plan, self.ctx.device, log_dir=options.log_dir,
                                      wandb_project=options.wandb_project) \
            if (options.log_dir is not None or options.wandb_project) and self.ctx.rank == 0 else None  # rank 0's
        self.trace = program.pipeline.trace if program.pipeline is not None else TraceRecorder(self.ctx.rank, 0)
        self._trace_path = options.trace
        # Periodic checkpoints (runtime/state/periodic.py): every ``checkpoint_every`` steps under
        # ``checkpoint_dir``, written in the background unless ``async_checkpoints=False``, the newest
        # ``keep_last`` kept; a run that finds an intact one there resumes from it (a restart).
        self.checkpoint_dir = options.checkpoint_dir
        self.checkpoint_every = options.checkpoint_every or 0
        self.keep_last = options.keep_last if options.keep_last is not None else periodic.DEFAULT_KEEP_LAST
        self.async_checkpoints = options.async_checkpoints is not False
        self._pending: sharded_state.Pending | None = None  # the periodic save being written in the background
        self._waits_at_exit = False
        self._staging: dict = {}  # its CPU copy, reused by the next one
        self.extra: dict = {}  # saved with every periodic checkpoint, restored on resume (e.g. the data position)
        self.resumed_from: Path | None = None
        if self.checkpoint_dir is not None:
            self._resume()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's call; on a pipeline plan, the inputs (this rank's share of the
        global batch, as ``train_step`` takes it) streamed through the stages: the whole
        batch's output, on every rank."""
        p = self._program
        if p.pipeline is None:
            return self.module(*args, **kwargs)
        local = kwargs.pop("local", False)
        if kwargs:
            raise PartitaError(f"a pipeline model takes its inputs positionally; got {sorted(kwargs)}",
                               hint="call model(x, ...) with the planned inputs in order")
        check_batch(p, args, None, local=local, caller="the model", with_targets=False)
        xs = [share(p, x, local=local) for x in args]
        self.collectives.reset()
        with FLIGHT.running():
            return p.pipeline.infer(xs, p.dp_group)

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
        names, reads = field_names(self._program), stage_reads(self._program)
        return tuple(n for i, n in enumerate(names) if reads is None or i in reads)

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """This rank's TP program (its stage's, in a pipeline; also at tp = 1 there or when the
        plan recomputes); None when the eager module runs."""
        return self._program.tp_module

    def full_state_dict(self, *, buffers: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter at full shape on every rank, however the plan spread them, and the
        persistent buffers unless ``buffers=False`` (a collective: call it on every rank).
        runtime/state/full.py says how."""
        return full_state.full_state_dict(self._program, buffers=buffers)

    def _resume(self) -> None:
        found, damaged = periodic.resume_point(self.checkpoint_dir)  # the newest intact one
        if self.ctx.rank == 0:
            for message in damaged:
                print(f"partita: {message}: skipped it", flush=True)
        if found is None:
            return
        self.extra = self.load_checkpoint(found)
        self.resumed_from = found
        if self.ctx.rank == 0:
            print(f"partita: resumed from {found} (step {self.step})", flush=True)

    def _checkpoint_if_due(self) -> None:
        if self.checkpoint_dir is not None and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self.wait_for_checkpoint()  # one save in flight at a time
            if self.async_checkpoints and not self._waits_at_exit:  # the last one completes before the process ends
                atexit.register(_wait_at_exit, weakref.ref(self))
                self._waits_at_exit = True
            self._pending = periodic.save_periodic(self._program, self.checkpoint_dir, step=self._step,
                                                   extra=self.extra, async_save=self.async_checkpoints,
                                                   keep_last=self.keep_last, buffers=self._staging,
                                                   scheduler=self.scheduler)

    def wait_for_checkpoint(self) -> None:
        """Wait until the periodic checkpoint being written in the background is complete (its
        marker written); a failed write is raised here as one ``CheckpointError``."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


    def check_replicas(self) -> None:
        """Raise ``PartitaError`` naming the first parameter that the plan replicates and whose
        copies differ: over "tp" (parameters not sharded there) and, without ZeRO, over "dp". A
        collective: every rank calls it (``check_replicas_every=N`` does, every N steps)."""
        p, tp = self._program, self.tensor_parallel
        local = p.local_parameters()
        checks = []
        if tp is not None and self.plan.mesh.tp > 1:
            checks.append(("tp", tp.tp.group, [(n, q) for n, (q, pl) in local.items() if not is_shard(pl)]))
        if p.dp_group is not None and p.zero is None:
            checks.append(("dp", p.dp_group, [(n, q) for n, (q, _) in local.items()]))
        for axis, group, named in checks:
            bad = replica_divergence(named, group, self.ctx.device)
            if bad is not None:
                name, ranks = bad
                raise PartitaError(
                    f"parameter {name} differs on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                    f"from the first rank of its {axis} group after step {self._step}, though the plan replicates it "
                    "there", hint="a bug in partita or a rank that changed its copy outside train_step; "
                    "report it with this message")

    @property
    def rank(self) -> int:
        """This process's rank in the job (0 outside torchrun): print and save on rank 0."""
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        """The processes the plan runs on (1 outside torchrun)."""
        return self.ctx.world_size

    @property
    def step(self) -> int:
        """Optimizer steps completed (restored by ``load_checkpoint``): a loop
        ``while model.step < N: model.train_step(...)`` resumes where it stopped."""
        return self._step

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers that are part of the model's state_dict, by name."""
        return self._program.persistent_buffers()

    def save_checkpoint(self, path: str | Path, *, extra: dict | None = None, async_save: bool = False) -> Any:
        """Save this run's state to directory ``path`` with torch.distributed.checkpoint, each rank
        writing only what it holds (a collective: call it on every rank). ``extra`` (plain Python
        values, e.g. the data position) comes back from ``load_checkpoint``. With ``async_save``
        the write goes on in the background: wait on the returned future before relying on it."""
        return sharded_state.save(self._program, path, step=self._step, extra=extra, async_save=async_save,
                                  scheduler=self.scheduler)

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
        self._step, extra = loading.load(self._program, path, optimizer=optimizer, partial=partial,
                                         scheduler=self.scheduler)
        return extra

    def write_trace(self, path: str | Path) -> Path | None:
        """Write the micro-batch timings of every step so far as a Chrome/Perfetto trace.

        Collective: every rank calls it; rank 0 writes ``path`` (and returns it)."""
        return self.trace.write(path, self.plan)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def train_step(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None, local: bool = False) -> StepResult:
        """One optimizer step over the global batch; returns its mean loss (equal on every rank), a
        float that also carries the step's gradient norm, time and throughput (``StepResult``).

        By default every rank passes the same global batch and takes its dp
        slice; with ``local=True`` each passes only its own share. The share is
        run as ``grad_accum_steps`` micro-batches of ``micro_batch_size``; the
        gradient is that of the mean loss over the global batch.
        """
        if self.optimizer is None:
            raise PlanError("this is an inference plan (optimizer \"none\"): call the model, not train_step",
                            hint="compile a training plan to train")
        p = self._program
        check_batch(p, inputs, targets, local=local, caller="train_step")
        if not local and self.ctx.world_size > 1 and self._step % self.batch_check_every == 0:
            check_same_batch(p, [*inputs, targets], self.collectives, step=self._step, caller="train_step")
        t0 = time.perf_counter()
        xs = [share(p, x, local=local) for x in inputs]
        y = share(p, targets, local=local)
        self.collectives.reset()
        with FLIGHT.running():  # the watchdog (runtime/watchdog.py) bounds every wait inside
            loss = self._train_step(xs, y)
            if p.buffers is not None:
                p.buffers.sync()  # batch norm's running statistics, the same on every replica
            seconds = time.perf_counter() - t0
            if self.check_replicas_every and self._step % self.check_replicas_every == 0:
                self.check_replicas()
        per_sample = tokens_per_sample(p, inputs, targets)
        result = StepResult(loss, step=self._step, grad_norm=self.grad_norm, seconds=seconds,
                            samples=self.plan.training.global_batch, tokens_per_sample=per_sample, lr=self._lr)
        self._report(result)
        if self.metrics_log is not None:
            self.metrics_log.write(result)
        self._checkpoint_if_due()  # outside: writing a large checkpoint may take longer than the limit
        return result

    def evaluate(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None, local: bool = False) -> float:
        """The mean loss over the global batch, without gradients or an optimizer step, on any
        training plan (TP, PP, ZeRO and their meshes alike); a collective: every rank calls it and
        gets the same float. Inputs as ``train_step`` takes them. The forward follows the module's
        mode, as PyTorch's does: after ``model.eval()`` dropout is off and batch norm uses its
        running statistics, which it leaves alone."""
        if self.optimizer is None:
            raise PlanError("this is an inference plan (optimizer \"none\"): its graph has no loss to evaluate",
                            hint="call the model for its outputs and apply the loss yourself, or compile a "
                            "training plan")
        p = self._program
        check_batch(p, inputs, targets, local=local, caller="evaluate")
        xs = [share(p, x, local=local) for x in inputs]
        y = share(p, targets, local=local)
        self.collectives.reset()
        with FLIGHT.running(), torch.no_grad():
            loss = self._evaluate(p, xs, y)
            if p.buffers is not None and self.training:
                p.buffers.sync()  # a forward in train mode updates running statistics (as PyTorch's does)
        return loss

    def _evaluate(self, p: Program, xs: list[torch.Tensor], y: torch.Tensor) -> float:
        if p.pipeline is not None:
            return p.pipeline.evaluate(xs, y, p.dp_group, p.zero)
        tr = self.plan.training
        steps, mbs = tr.grad_accum_steps, tr.micro_batch_size
        total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for i in range(steps):
            if p.zero is not None:
                p.zero.begin_forward()  # ZeRO-3 gathers each parameter where it is read, then frees it
            total += p.loss([x[i * mbs:(i + 1) * mbs] for x in xs], y[i * mbs:(i + 1) * mbs]).float()
        total /= steps * p.dp_size
        if p.dp_group is not None:
            self.collectives.record("all_reduce", MeshAxis.DP.value, total.element_size())
            dist.all_reduce(total, group=p.dp_group)
        return float(total)

    def _train_step(self, xs: list[torch.Tensor], y: torch.Tensor) -> float:
        tr, p = self.plan.training, self._program
        if p.pipeline is not None:
            mean = p.pipeline.train_step(xs, y, p.averager, p.dp_group, p.zero, loss_scale=self._loss_scale)
            self._optimizer_step(skip=not self._finite(mean))
            self._step += 1
            return mean
        steps, mbs = tr.grad_accum_steps, tr.micro_batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        loss_work = None
        for i in range(steps):
            last = i == steps - 1
            rows = slice(i * mbs, (i + 1) * mbs)
            if p.zero is not None:
                p.zero.begin_micro_batch(last)  # before the forward: ZeRO-3 gathers parameters in it
            with self.trace.span(FORWARD, i):
                loss = p.loss([x[rows] for x in xs], y[rows])
            loss_sum += loss.detach().float()
            if last and p.dp_group is not None:
                # Average the loss while the last backward runs.
                loss_sum.div_(steps * p.dp_size)
                loss_work = dist.all_reduce(loss_sum, group=p.dp_group, async_op=True)
                self.collectives.record("all_reduce", MeshAxis.DP.value, loss_sum.element_size())
            if p.averager is not None:
                p.averager.begin(sync=last)
            # Each rank's gradient is the mean over its share; the averager's (or ZeRO's)
            # dp mean then makes it the mean over the global batch.
            with self.trace.span(BACKWARD, i):
                (loss * (self._loss_scale / steps)).backward()
            if p.zero is not None:
                p.zero.after_backward()
        if p.averager is not None:
            p.averager.finish()
        self.trace.step += 1
        if loss_work is not None:
            loss_work.wait()
        else:
            loss_sum.div_(steps)
        mean = float(loss_sum)  # the same on every rank: each decides alike whether the step counts
        self._optimizer_step(skip=not self._finite(mean))
        self._step += 1
        return mean

    def _finite(self, loss: float) -> bool:
        """Whether the step's mean loss is finite; if not, the ``nonfinite`` policy: "stop" raises
        (the gradients dropped, the parameters as before the step), "skip" says so in one line and
        the step changes nothing."""
        if math.isfinite(loss):
            return True
        if self.nonfinite == "stop":
            self._optimizer_step(skip=True)  # drops the gradients: the model stays usable
            raise PartitaError(f"step {self._step}: the loss is {loss} (not finite); the parameters are left as "
                               "they were before this step", hint="look for NaN or inf in the batch, or lower the "
                               "learning rate; nonfinite='skip' (PARTITA_NONFINITE=skip, `partita run --nonfinite "
                               "skip`) leaves such steps out instead")
        self.nonfinite_skipped += 1
        if self.ctx.rank == 0:
            print(f"partita: step {self._step} skipped: the loss is {loss} (not finite); the parameters are "
                  f"unchanged ({self.nonfinite_skipped} skipped so far, nonfinite='skip')", flush=True)
        return False

    def _report(self, result: StepResult) -> None:
        """Rank 0: the plan once, then a progress line every ``log_every`` steps, measured next to
        predicted (``log_every=0`` / ``PARTITA_LOG_EVERY=0``: silent). A step is named by its index
        from 0, as a user's loop and the metrics log (runtime/metrics.py) count it."""
        if self.ctx.rank != 0 or not self.log_every:
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
                  + (f", {self.skipped_steps} skipped (fp16 overflow)" if self.skipped_steps else ""), flush=True)

    @property
    def _loss_scale(self) -> float:
        """What the loss is multiplied by before backward (fp16's dynamic scale, else 1)."""
        return self._program.scaler.scale if self._program.scaler is not None else 1.0

    def _optimizer_step(self, *, skip: bool = False) -> None:
        """The one optimizer's step on every rank, or on none (``skip``: a loss that was not finite;
        fp16: an inf or nan gradient on any rank); clipped to the plan's ``max_grad_norm`` by the
        global gradient norm (runtime/grad_norm.py), whose all-reduce also tells every rank whether
        any gradient overflowed. The gradients are dropped either way."""
        p = self._program
        inv_scale = 1.0 / self._loss_scale
        reduced = p.averager.reduced_grads() if p.averager is not None else {}
        reducers = [r for r in (p.averager, p.zero.reducer if p.zero is not None else None) if r is not None]
        norm = global_grad_norm(p, self.plan.mesh.tp, self.ctx.device, inv_scale, reduced,
                                unreached_here=any(r.unreached_here() for r in reducers))
        self.grad_norm = norm.norm
        # a parameter no rank's backward reached keeps no gradient, as in one process (runtime/dp/buckets.py)
        unreached = [r.unreached() for r in reducers] if norm.unreached else [[] for _ in reducers]
        if p.averager is not None:
            for q in unreached[0]:
                q.grad = None
                reduced.pop(id(q), None)
        skip = skip or (p.scaler is not None and not math.isfinite(self.grad_norm))
        self._lr = float(self.optimizer.param_groups[0]["lr"])
        inv_scale *= clip_coefficient(self.grad_norm, self.plan.training.max_grad_norm)
        if p.zero is not None:
            if not skip:  # the optimizer on this rank's shards, then the parameters all-gathered
                p.zero.step(inv_scale, frozen=unreached[-1])
            p.zero.zero_grad()
            if p.averager is not None:
                p.averager.zero_grad()
        else:
            if not skip:
                p.master.step(inv_scale, reduced)
            if p.averager is not None:
                p.averager.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=True)
                for q in p.master.params:
                    q.grad = None
        if self.scheduler is not None and not skip:  # a step left out leaves the schedule where it was
            self.scheduler.step()
        if p.scaler is not None:
            p.scaler.update(skip)
            self.skipped_steps = p.scaler.skipped
        if self._trace_path:
            self.write_trace(self._trace_path)


def _wait_at_exit(ref: weakref.ref) -> None:
    """At exit: the periodic checkpoint still being written completes, or its failure is said."""
    model = ref()
    try:
        if model is not None:
            model.wait_for_checkpoint()
    except PartitaError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)


def apply_plan(module: nn.Module, plan: Plan, options: Options | None = None, *,
               ctx: DistContext | None = None) -> ParallelModel:
    """Wrap ``module`` to run ``plan`` on this rank (the parts are applied by ``compose``), as
    ``options`` say (core/options.py): the loss and the optimizer factory; ``weights`` (a
    ``torch.save``d state dict or a .safetensors file: under tensor parallelism each rank reads
    only its slices, so ``module`` may be built on the meta device); ``checkpoint_dir`` /
    ``checkpoint_every`` (a sharded checkpoint every N steps there, and resuming from the newest
    intact one found at construction: runtime/state/periodic.py); ``watchdog_s`` (how long a
    step may wait: runtime/watchdog.py, default 300 s, 0 off)."""
    return ParallelModel(module, plan, options, ctx=ctx)
