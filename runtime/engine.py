"""Runs a plan: one ``ParallelModel`` per rank, whose ``train_step`` is the user's loop.

``compose`` is the one place that states in which order a plan's parts are
applied to the user's module; each part lives in the runtime file named for its
axis (``tensor_parallel.py``, ``pipeline_parallel.py``, ``data_parallel.py``,
``zero.py``).

Tracing: ``ParallelModel.write_trace(path)`` (collective: every rank calls it)
gathers each rank's per-micro-batch forward / backward spans to rank 0, which
writes a Chrome/Perfetto trace (runtime/trace.py). With ``PARTITA_TRACE=path``
in the environment, ``train_step`` does so after every step, so the file holds
all steps so far when the run ends.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from partita.core.errors import PartitaError, PlanError
from partita.core.losses import training_loss
from partita.core.placement import is_shard
from partita.core.plan import MeshAxis, Plan
from partita.core.precision import PrecisionPolicy
from partita.runtime.data_parallel import CollectiveCounter, GradientAverager
from partita.runtime.distributed import DistContext, build_mesh, init_distributed
from partita.runtime.grad_norm import clip_coefficient, global_grad_norm
from partita.runtime.mixed_precision import LossScaler, MasterWeights, cast_parameters
from partita.runtime.pipeline_parallel import SCHEDULES, PipelineStage
from partita.runtime.rng import fingerprint, replica_divergence, run_seed
from partita.runtime.tensor_parallel import TensorParallel
from partita.runtime.trace import BACKWARD, FORWARD, TraceRecorder
from partita.runtime.watchdog import FLIGHT, watch
from partita.runtime.zero import ZeroProgram, apply_zero

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def refuse_unsupported(plan: Plan) -> None:
    """Raise ``PlanError`` for plan parts this runtime cannot execute, rather than run them wrong."""
    later = "this runtime executes data-, tensor- and pipeline-parallel plans; {} arrives in a later version"
    for axis, what in (("tp", "tensor-parallel"), ("pp", "pipeline")):
        if getattr(plan.mesh, axis) > 1 and not plan.nodes:
            raise PlanError(f"the plan has {axis}={getattr(plan.mesh, axis)} but no {what} node decisions",
                            hint="recompile the plan with `partita compile`")
    t = plan.training
    if t.zero_stage > 0 and plan.mesh.dp == 1:
        raise PlanError(f"the plan has ZeRO-{t.zero_stage} but dp=1: there is no data-parallel group to shard over",
                        hint="recompile the plan with `partita compile`")
    if plan.mesh.pp > 1 and not t.inference and t.schedule not in SCHEDULES:
        raise PlanError(f"the plan has pp={plan.mesh.pp} but schedule {t.schedule!r}; this runtime runs "
                        f"{' and '.join(SCHEDULES)}", hint="recompile the plan with `partita compile`")
    recomputing = [s.index for s in plan.stages if s.recompute]
    if recomputing and not plan.nodes:
        raise PlanError(f"the plan recomputes activations on stage(s) {recomputing} but has no node "
                        f"decisions to find the repeated layers by", hint="recompile the plan with `partita compile`")
    if recomputing and t.zero_stage == 3:
        # ZeRO-3 gathers a node's parameters before it runs and frees the bucket after forward's
        # last reader; the rerun in backward would gather and release again, freeing the storage
        # under the views the recomputed forward has just saved for the backward that follows.
        raise PlanError(f"the plan recomputes activations on stage(s) {recomputing} with ZeRO-3: this runtime "
                        f"cannot rerun a layer's forward while ZeRO-3 gathers and frees its parameters per node",
                        hint="recompile with ZeRO <= 2 (`partita compile --zero 2`) or without "
                        "recomputation (`--no-recompute`)")


@dataclass
class _Program:
    """What ``compose`` builds for this rank."""

    module: nn.Module
    loss: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor] | None  # one micro-batch's loss (pp == 1)
    optimizer: Optimizer | None  # None for an inference plan: the user's, on the masters (runtime/mixed_precision.py)
    averager: GradientAverager | None
    zero: ZeroProgram | None
    dp_group: dist.ProcessGroup | None
    dp_rank: int
    dp_size: int
    pipeline: PipelineStage | None = None  # pp > 1: this rank's stage, which runs the schedule
    master: MasterWeights | None = None  # without ZeRO: what the optimizer updates (ZeRO has its own)
    policy: PrecisionPolicy = PrecisionPolicy()
    scaler: LossScaler | None = None  # fp16: the dynamic loss scale

    @property
    def updates(self) -> MasterWeights | None:
        """The one optimizer's masters: ZeRO's (its shards and the parameters it was given) or the plain one."""
        return self.zero.master if self.zero is not None else self.master

    @property
    def interpreter(self) -> TensorParallel | None:
        """This rank's TP program (its stage's, in a pipeline); None on the eager path."""
        return _interpreter(self.module, self.pipeline)


def _interpreter(module: nn.Module, pipeline: PipelineStage | None) -> TensorParallel | None:
    if pipeline is not None:
        return pipeline.tp
    return module if isinstance(module, TensorParallel) else None


def _broadcast_from_rank0(module: nn.Module, group: dist.ProcessGroup) -> None:
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def compose(
    module: nn.Module,
    plan: Plan,
    ctx: DistContext,
    optimizer: OptimizerFactory,
    counter: CollectiveCounter,
    bucket_bytes: int | None = None,
    *,
    loss_fn: LossFn,
    checkpoint: str | Path | None = None,
) -> _Program:
    """Apply a plan's parts to ``module`` for this rank, in this order:

    1. tensor parallel: keep this rank's parameter shards and build the local
       program over the "tp" group (tp == 1 keeps the eager module, unless the
       plan recomputes activations: then the program runs with a one-rank TP
       group, so that recomputation is the interpreter's, as at tp > 1).
       First, because every later part must see the parameters as this rank
       holds them. Activation recomputation (``Stage.recompute``) runs inside
       the program: each repeated layer of a recomputing stage is checkpointed
       and its forward, TP collectives included, rerun in backward
       (runtime/tensor_parallel.py); not with ZeRO-3 (``refuse_unsupported``).
    2. pipeline split: keep this rank's stage. Built as the TP program
       restricted to the stage's nodes (one construction: the stage shards and
       holds only its own parameters, even at tp == 1, where the program runs
       with a one-rank TP group); before DP/ZeRO, so those wrap only the stage's
       own parameters.
    3. ZeRO / data parallel: broadcast the (local) replicas over "dp", then
       either hook gradient averaging or shard the model state over "dp" (ZeRO
       1/2/3: runtime/zero.py builds the optimizer on the flat shards; ZeRO-3
       gathers parameters per graph node in the TP interpreter, which runs
       every tp > 1 or pp > 1 plan, else around each module's forward). After TP and PP,
       because it acts on the final local parameters; and the optimizer is
       built last of all for the same reason.
    4. the schedule: ``ParallelModel.train_step``'s micro-batch loop, or the
       pipeline's GPipe / 1F1B schedule, which drives all of the above.
    """
    plan.check_matches(world_size=ctx.world_size)
    refuse_unsupported(plan)
    device_mesh = build_mesh(plan.mesh, ctx)
    policy = PrecisionPolicy.of(plan.training)
    graph_loss = None if plan.training.inference else loss_fn  # an inference plan's graph has no loss
    pipeline = None
    # 1. tensor parallel, and 2. the pipeline split
    if plan.mesh.pp > 1:
        module = pipeline = PipelineStage(module, plan, device_mesh, loss_fn=graph_loss, counter=counter,
                                          device=ctx.device, checkpoint=checkpoint)
        loss = None  # the stage's schedule runs the micro-batches
    elif plan.mesh.tp > 1 or any(s.recompute for s in plan.stages):
        tp_group = device_mesh[MeshAxis.TP.value].get_group() if plan.mesh.tp > 1 else None
        module = TensorParallel(module, plan, tp_group, loss_fn=graph_loss, counter=counter,
                                device=ctx.device, checkpoint=checkpoint)
        tp_module = module

        def loss(xs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
            return tp_module(*xs, targets=y)
    else:
        if checkpoint is not None:
            from partita.runtime.sharded_state import open_weights

            _load_weights(module, open_weights(checkpoint))
        module = module.to(ctx.device)
        eager = module

        def loss(xs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
            with policy.autocast(ctx.device):
                return training_loss(loss_fn, eager, xs, y)
    # the precision policy (core/precision.py): parameters in its dtype before DP / ZeRO lay
    # out their buckets; the interpreter runs its forward under autocast, the pipeline sends in it
    cast_parameters(module, policy)
    # 3. data parallel.
    averager = None
    dp_group, dp_rank, dp_size = None, 0, 1
    if device_mesh is not None and plan.mesh.dp > 1:
        dp_mesh = device_mesh[MeshAxis.DP.value]
        dp_group, dp_rank, dp_size = dp_mesh.get_group(), dp_mesh.get_local_rank(), plan.mesh.dp
        _broadcast_from_rank0(module, dp_group)
    interpreter = _interpreter(module, pipeline)
    if interpreter is not None:
        interpreter.precision = policy
        if ctx.world_size > 1:
            interpreter.rng = (run_seed(), dp_rank)  # random ops drawn alike over "tp" (runtime/rng.py)
    zero = None
    master = None
    reduce = policy.reduce_dtype
    buckets = bucket_bytes or plan.training.grad_bucket_bytes
    if dp_group is not None and not plan.training.inference and plan.training.zero_stage > 0:
        # A parameter tied across pipeline stages stays whole on each (its copies' gradients are
        # summed between the stages, which lay out their ZeRO buckets differently): plain dp
        # averaging and its own optimizer, the same elementwise update.
        tied = {id(q) for q in pipeline.tied_parameters} if pipeline is not None else set()
        kept = [q for q in module.parameters() if id(q) in tied]
        zero = apply_zero([(n, q) for n, q in module.named_parameters() if id(q) not in tied],
                          plan.training.zero_stage, dp_group, optimizer_factory=optimizer,
                          bucket_bytes=buckets, counter=counter, axis=MeshAxis.DP.value,
                          precision=policy, extra_params=kept)  # one optimizer, the tied ones included
        if plan.training.zero_stage == 3:
            interpreter = _interpreter(module, pipeline)
            if interpreter is not None:
                interpreter.param_access = zero  # each graph node gathers what it reads
            else:
                zero.install_module_hooks(module)  # the eager path: around each module's forward
        opt = zero.optimizer
        if kept:
            averager = GradientAverager(kept, dp_group, bucket_bytes=buckets, counter=counter,
                                        axis=MeshAxis.DP.value, reduce_dtype=reduce)
    elif not plan.training.inference:
        if dp_group is not None:
            averager = GradientAverager(module.parameters(), dp_group, bucket_bytes=buckets, counter=counter,
                                        axis=MeshAxis.DP.value, reduce_dtype=reduce)
        master = MasterWeights([q for q in module.parameters() if q.requires_grad], optimizer, policy)
        opt = master.optimizer
    else:
        opt = None
    scaler = LossScaler(policy) if policy.loss_scaling and not plan.training.inference else None
    return _Program(module, loss, opt, averager, zero, dp_group, dp_rank, dp_size, pipeline, master, policy, scaler)


def _load_weights(module: nn.Module, weights: Any) -> None:
    """Pretrained ``weights`` into the eager module, strictly: a missing or extra name is the
    user's to fix."""
    weights = dict(weights)
    for names in _state_names(module).values():  # a file that keeps one name of tied weights
        have = next((n for n in names if n in weights), None)
        for n in names:
            if have is not None and n not in weights:
                weights[n] = weights[have]
    try:  # copied into the parameters (tied ones stay one); assigned only onto a meta-device model
        module.load_state_dict(weights, assign=any(p.is_meta for p in module.parameters()), strict=True)
    except RuntimeError as e:
        raise PartitaError(f"the weights do not fit this model: {str(e).splitlines()[0]} {str(e).splitlines()[1:2]}",
                           hint="pass the state dict of this model (its names as in model.state_dict())") from e


def _state_names(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names in ``module.state_dict()`` (tied weights)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(p), name), []).append(name)
    return names


class ParallelModel(nn.Module):
    """The user's module, run as the plan says; ``train_step`` is the whole training step.

    Calling it, and attribute access, fall through to the wrapped module; a
    backward run outside ``train_step`` accumulates gradients locally and does
    not average them.
    Parameters are broadcast from dp rank 0 at construction: ranks that built
    the model under different seeds would otherwise train different replicas
    and silently diverge, since averaged gradients cannot bring them together.
    """

    def __init__(
        self,
        module: nn.Module,
        plan: Plan,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        ctx: DistContext | None = None,
        bucket_bytes: int | None = None,
        checkpoint: str | Path | None = None,
        watchdog_s: float | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int | None = None,
        check_replicas_every: int | None = None,
    ) -> None:
        super().__init__()
        self.ctx = ctx if ctx is not None else init_distributed(watchdog_s=watchdog_s)
        # before any collective: a hang from here on ends with one message (runtime/watchdog.py)
        watch(rank=self.ctx.rank, world_size=self.ctx.world_size, mesh=plan.mesh, timeout_s=watchdog_s)
        self.plan = plan
        self.loss_fn = loss_fn
        self.collectives = CollectiveCounter()  # calls issued by the last train_step
        # the unwrapped model's state_dict names (tied names too) and persistent buffers, read
        # before the plan's parts take the module apart: checkpoints use them (runtime/sharded_state.py)
        self.state_names = _state_names(module)
        self._persistent = {k for k, _ in module.named_buffers() if k in module.state_dict(keep_vars=True)}
        self._step = 0
        self.grad_norm = float("nan")  # the last step's global gradient norm (before clipping)
        self.log_every = int(os.environ.get("PARTITA_LOG_EVERY", "10") or 0)  # rank 0's progress line
        self.skipped_steps = 0  # fp16: steps skipped for an inf or nan gradient (the loss scale halved)
        self.batch_check_every = max(1, int(os.environ.get("PARTITA_BATCH_CHECK_EVERY", "100") or 100))
        # every N steps, replicated parameters compared across their groups (0: never; runtime/rng.py)
        self.check_replicas_every = (check_replicas_every if check_replicas_every is not None
                                     else int(os.environ.get("PARTITA_CHECK_REPLICAS_EVERY", "0") or 0))
        program = compose(module, plan, self.ctx, optimizer, self.collectives, bucket_bytes,
                          loss_fn=loss_fn, checkpoint=checkpoint)
        self.module = program.module
        self.optimizer = program.optimizer
        self._program = program
        self.trace = program.pipeline.trace if program.pipeline is not None else TraceRecorder(self.ctx.rank, 0)
        self._trace_path = os.environ.get("PARTITA_TRACE")
        # Periodic checkpoints (runtime/sharded_state.py): every ``checkpoint_every`` steps under
        # ``checkpoint_dir``, and a run that finds a complete one there resumes from it (a restart).
        self.checkpoint_dir = checkpoint_dir or os.environ.get("PARTITA_CHECKPOINT_DIR") or None
        self.checkpoint_every = checkpoint_every or int(os.environ.get("PARTITA_CHECKPOINT_EVERY", "0") or 0)
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
        self._check_batch(args, None, local)
        xs = [self._share(x, local) for x in args]
        self.collectives.reset()
        with FLIGHT.running():
            return p.pipeline.infer(xs, p.dp_group)

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """This rank's TP program (its stage's, in a pipeline; also at tp = 1 there or when the
        plan recomputes); None when the eager module runs."""
        return self._program.interpreter

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at full shape on every rank, however the plan spread them (a collective:
        call it on every rank). runtime/checkpoint.py says how."""
        from partita.runtime.checkpoint import full_state_dict

        return full_state_dict(self)

    def _resume(self) -> None:
        from partita.runtime.sharded_state import latest

        found = latest(self.checkpoint_dir)
        if found is None:
            return
        self.extra = self.load_checkpoint(found)
        self.resumed_from = found
        if self.ctx.rank == 0:
            print(f"partita: resumed from {found} (step {self.step})", flush=True)

    def _checkpoint_if_due(self) -> None:
        if self.checkpoint_dir is not None and self.checkpoint_every and self.step % self.checkpoint_every == 0:
            from partita.runtime.sharded_state import save_periodic

            save_periodic(self, self.checkpoint_dir, self.extra)

    def check_replicas(self) -> None:
        """Raise ``PartitaError`` naming the first parameter that the plan replicates and whose
        copies differ: over "tp" (parameters not sharded there) and, without ZeRO, over "dp". A
        collective: every rank calls it (``check_replicas_every=N`` does, every N steps)."""
        p, tp = self._program, self.tensor_parallel
        local = ({n: (q, pl) for n, (q, pl) in tp.local_parameters().items()} if tp is not None
                 else {n: (q, "replicate") for n, q in self.module.named_parameters()})
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
    def step(self) -> int:
        """Optimizer steps completed (restored by ``load_checkpoint``): a loop
        ``while model.step < N: model.train_step(...)`` resumes where it stopped."""
        return self._step

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers that are part of the model's state_dict, by name."""
        tp = self.tensor_parallel
        if tp is None:
            return {k: b for k, b in self.module.named_buffers() if k in self._persistent}
        return {tp.buffer_nodes[n]: b for n, b in tp.buffers_by_node().items()
                if tp.buffer_nodes[n] in self._persistent}

    def save_checkpoint(self, path: str | Path, *, extra: dict | None = None, async_save: bool = False) -> Any:
        """Save this run's state to directory ``path`` with torch.distributed.checkpoint, each rank
        writing only what it holds (a collective: call it on every rank). ``extra`` (plain Python
        values, e.g. the data position) comes back from ``load_checkpoint``. With ``async_save``
        the write goes on in the background: wait on the returned future before relying on it."""
        from partita.runtime.sharded_state import save

        return save(self, path, extra=extra, async_save=async_save)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore the state saved in ``path`` (under this plan or any other: DCP reshards), in
        place; returns the saved ``extra``. A collective: call it on every rank."""
        from partita.runtime.sharded_state import load

        return load(self, path)

    def write_trace(self, path: str | Path) -> Path | None:
        """Write the micro-batch timings of every step so far as a Chrome/Perfetto trace.

        Collective: every rank calls it; rank 0 writes ``path`` (and returns it)."""
        return self.trace.write(path, self.plan)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def _check_batch(self, inputs: tuple[Any, ...], targets: Any, local: bool) -> None:
        """Refuse a batch the plan was not made for before any of it runs: the number of inputs,
        then per tensor its batch size (the global batch, or this rank's share with ``local``), the
        other dims and the dtype against the captured inputs and targets."""
        from partita.core.inputs import parse_input_spec

        tr, p = self.plan.training, self._program
        specs = [parse_input_spec(s) for s in self.plan.model.inputs]
        given = ", ".join(self.plan.model.inputs)
        if specs and len(inputs) != len(specs):
            raise PartitaError(f"train_step got {len(inputs)} input{'s' if len(inputs) != 1 else ''}, but the model "
                               f"was planned for {len(specs)} ({given})",
                               hint="pass the model's inputs positionally, in the order they were planned, "
                               "and the targets as targets=")
        expected = tr.global_batch // p.dp_size if local else tr.global_batch
        scope = (f"this rank's share (global_batch={tr.global_batch} / dp={p.dp_size})" if local
                 else "the plan's global_batch")
        target_spec = parse_input_spec(self.plan.model.targets) if self.plan.model.targets else None
        pairs = [(x, spec, f"input {i} ({spec.name})") for i, (x, spec) in enumerate(zip(inputs, specs))]
        if targets is not None:  # None: a pipeline model's forward
            pairs.append((targets, target_spec, "targets"))
        for t, spec, what in pairs:
            if not isinstance(t, torch.Tensor):
                raise PartitaError(f"train_step got {what} as {type(t).__name__}, not a tensor",
                                   hint="pass torch tensors")
            size = t.shape[0] if t.dim() > 0 else None
            if size != expected:
                raise PartitaError(
                    f"train_step got {what} with batch size {size}, but {scope} is {expected}",
                    hint=(f"pass {tr.global_batch // p.dp_size} rows per rank" if local else
                          f"pass the same global batch of {expected} on every rank, or local=True with "
                          f"{tr.global_batch // p.dp_size} rows per rank"))
            if spec is None:
                continue
            planned = str(spec)
            if tuple(t.shape[1:]) != tuple(spec.shape[1:]):
                raise PartitaError(f"train_step got {what} with shape {list(t.shape)}, but the plan was made for "
                                   f"{planned}: every dim but the batch must match",
                                   hint="pass tensors of the planned shape, or recompile for this shape")
            if t.dtype != spec.dtype:
                raise PartitaError(f"train_step got {what} with dtype {str(t.dtype).removeprefix('torch.')}, but the "
                                   f"plan was made for {planned}",
                                   hint=f"convert it (.to(torch.{str(spec.dtype).removeprefix('torch.')})) "
                                   "or recompile for this dtype")

    def _share(self, t: torch.Tensor, local: bool) -> torch.Tensor:
        """This rank's rows of ``t`` (checked by ``_check_batch``), on its device."""
        p = self._program
        if not local and p.dp_size > 1:
            rows = t.shape[0] // p.dp_size
            t = t.narrow(0, p.dp_rank * rows, rows)
        return t.to(self.ctx.device, non_blocking=True)

    def _check_same_batch(self, tensors: list[torch.Tensor]) -> None:
        """Every rank passed the same global batch (a fingerprint per rank, all-gathered): one rank
        with other data would otherwise train on silently. Run on the first step and every
        ``batch_check_every`` (``PARTITA_BATCH_CHECK_EVERY``, default 100) after."""
        mine = torch.tensor([fingerprint(t) for t in tensors], dtype=torch.int64, device=self.ctx.device)
        every = mine.new_empty(self.ctx.world_size * mine.numel())
        with self.collectives.blocking("all_gather", "world"):
            dist.all_gather_into_tensor(every, mine)
        every = every.cpu().view(self.ctx.world_size, mine.numel())
        differ = [r for r in range(self.ctx.world_size) if not torch.equal(every[r], every[0])]
        if differ:
            raise PartitaError(
                f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} passed another global batch "
                f"to train_step than rank 0 at step {self._step}",
                hint="every rank must pass the same global batch (seed the data loader alike on every rank), "
                "or pass local=True with each rank's own share")

    def train_step(self, *inputs: torch.Tensor, targets: torch.Tensor, local: bool = False) -> "StepResult":
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
        self._check_batch(inputs, targets, local)
        if not local and self.ctx.world_size > 1 and self._step % self.batch_check_every == 0:
            self._check_same_batch([*inputs, targets])
        t0 = time.perf_counter()
        xs = [self._share(x, local) for x in inputs]
        y = self._share(targets, local)
        self.collectives.reset()
        with FLIGHT.running():  # the watchdog (runtime/watchdog.py) bounds every wait inside
            loss = self._train_step(xs, y)
            seconds = time.perf_counter() - t0
            if self.check_replicas_every and self._step % self.check_replicas_every == 0:
                self.check_replicas()
        first = inputs[0] if inputs else targets
        per_sample = math.prod(first.shape[1:]) if not first.is_floating_point() and first.dim() > 1 else None
        result = StepResult(loss, step=self._step, grad_norm=self.grad_norm, seconds=seconds,
                            samples=self.plan.training.global_batch, tokens_per_sample=per_sample)
        self._report(result)
        self._checkpoint_if_due()  # outside: writing a large checkpoint may take longer than the limit
        return result

    def _train_step(self, xs: list[torch.Tensor], y: torch.Tensor) -> float:
        tr, p = self.plan.training, self._program
        if p.pipeline is not None:
            mean = p.pipeline.train_step(xs, y, p.averager, p.dp_group, p.zero, loss_scale=self._loss_scale)
            self._optimizer_step()
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
        self._optimizer_step()
        self._step += 1
        if loss_work is not None:
            loss_work.wait()
        else:
            loss_sum.div_(steps)
        return float(loss_sum)

    def _report(self, result: "StepResult") -> None:
        """Rank 0: the plan once, then a progress line every ``log_every`` steps, measured next to
        predicted (``log_every=0`` / ``PARTITA_LOG_EVERY=0``: silent)."""
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
            print(f"partita: step {result.step} loss {float(result):.4f} grad norm {result.grad_norm:.3g} "
                  f"{result.seconds * 1e3:.0f} ms/step (predicted {pred.step_time_s * 1e3:.0f}){rate}"
                  + (f", {self.skipped_steps} skipped (fp16 overflow)" if self.skipped_steps else ""), flush=True)

    @property
    def _loss_scale(self) -> float:
        """What the loss is multiplied by before backward (fp16's dynamic scale, else 1)."""
        return self._program.scaler.scale if self._program.scaler is not None else 1.0

    def _optimizer_step(self) -> None:
        """The one optimizer's step on every rank, or (fp16, an inf or nan gradient on any rank) on
        none; clipped to the plan's ``max_grad_norm`` by the global gradient norm (runtime/grad_norm.py),
        whose all-reduce also tells every rank whether any gradient overflowed."""
        p = self._program
        inv_scale = 1.0 / self._loss_scale
        self.grad_norm = global_grad_norm(p, self.plan.mesh.tp, self.ctx.device, inv_scale)
        skip = p.scaler is not None and not math.isfinite(self.grad_norm)
        inv_scale *= clip_coefficient(self.grad_norm, self.plan.training.max_grad_norm)
        if p.zero is not None:
            if not skip:
                p.zero.step(inv_scale)  # the optimizer on this rank's shards, then the parameters all-gathered
            p.zero.zero_grad()
            if p.averager is not None:
                p.averager.zero_grad()
        else:
            if not skip:
                p.master.step(inv_scale)
            if p.averager is not None:
                p.averager.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=True)
                for q in p.master.params:
                    q.grad = None
        if p.scaler is not None:
            p.scaler.update(skip)
            self.skipped_steps = p.scaler.skipped
        if self._trace_path:
            self.write_trace(self._trace_path)


class StepResult(float):
    """``train_step``'s mean loss (a float, as before), with what else the step measured:
    ``grad_norm`` (the global gradient norm, before clipping), ``seconds`` (wall time of the step
    on this rank), ``samples_per_s`` and, for token inputs, ``tokens_per_s``; ``step`` is
    ``model.step`` after it."""

    step: int
    grad_norm: float
    seconds: float
    samples_per_s: float
    tokens_per_s: float | None

    def __new__(cls, loss: float, *, step: int, grad_norm: float, seconds: float, samples: int,
                tokens_per_sample: int | None) -> "StepResult":
        self = super().__new__(cls, loss)
        self.step, self.grad_norm, self.seconds = step, grad_norm, seconds
        self.samples_per_s = samples / seconds if seconds > 0 else float("inf")
        self.tokens_per_s = self.samples_per_s * tokens_per_sample if tokens_per_sample else None
        return self

    @property
    def loss(self) -> float:
        return float(self)


def apply_plan(
    module: nn.Module,
    plan: Plan,
    *,
    loss_fn: LossFn,
    optimizer: OptimizerFactory,
    ctx: DistContext | None = None,
    bucket_bytes: int | None = None,
    checkpoint: str | Path | None = None,
    watchdog_s: float | None = None,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    check_replicas_every: int | None = None,
) -> ParallelModel:
    """Wrap ``module`` to run ``plan`` on this rank (the parts are applied by ``compose``).

    With ``checkpoint`` (a ``torch.save``d state dict) the weights come from the
    file; under tensor parallelism each rank reads only its slices, so ``module``
    may be built on the meta device. ``checkpoint_dir`` / ``checkpoint_every``: a sharded checkpoint
    every N steps there, and resuming from the newest complete one found at construction
    (runtime/sharded_state.py). ``watchdog_s`` bounds every wait of a step (runtime/watchdog.py;
    default ``PARTITA_WATCHDOG_S`` or 300 s, 0 turns it off)."""
    return ParallelModel(module, plan, loss_fn=loss_fn, optimizer=optimizer, ctx=ctx,
                         bucket_bytes=bucket_bytes, checkpoint=checkpoint, watchdog_s=watchdog_s,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                         check_replicas_every=check_replicas_every)
