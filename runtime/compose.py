"""``compose``: a plan's parts applied to the user's module for this rank, in one stated order.

Each part lives in the runtime file named for its axis, as an ``apply_*`` step
that takes what it needs as arguments: ``apply_tensor_parallel``
(runtime/tp/module.py), ``apply_pipeline`` (runtime/pipeline/stage.py),
``apply_mixed_precision`` (runtime/mixed_precision.py), ``apply_data_parallel``
(runtime/dp/averaging.py) and ``apply_zero`` (runtime/dp/zero.py). ``refuse_unsupported``
names the plans this runtime cannot run, before anything is built. The order, and why:
``compose``'s docstring and docs/runtime.md, "compose's order".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from partita.core.buckets import unit_of
from partita.core.errors import PartitaError, PlanError
from partita.core.mesh import MeshAxis
from partita.core.model.capture import uncompiled
from partita.core.model.losses import training_loss
from partita.core.model.ops import running_buffers
from partita.core.optimizers import NO_OFFLOAD
from partita.core.options import Options
from partita.core.plans.plan import Plan
from partita.core.precision import PrecisionPolicy
from partita.core.recompute import NONE
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.cp.attention import ContextGroup
from partita.runtime.distributed import GROUPS, DistContext, build_mesh, context_group, expert_groups
from partita.runtime.dp.averaging import (
    Averagers,
    BufferAverager,
    GradientAverager,
    apply_data_parallel,
    broadcast_replicas,
    running_statistics,
)
from partita.runtime.dp.zero import ZeroProgram, apply_zero
from partita.runtime.experts import ExpertGroup
from partita.runtime.mixed_precision import MasterWeights, OptimizerFactory, apply_mixed_precision, kept_whole
from partita.runtime.pipeline.stage import SCHEDULES, PipelineStage, apply_pipeline
from partita.runtime.program import MicroBatchLoss, Program, tp_module_of
from partita.runtime.rng import run_seed
from partita.runtime.state.weights import load_eager, open_weights, state_names
from partita.runtime.step.sync import Averaged, GradientSync, OneReplica, Sharded
from partita.runtime.tp.module import TensorParallel, apply_tensor_parallel
from partita.runtime.tp.program import compiled

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
DP, TP, EDP = MeshAxis.DP.value, MeshAxis.TP.value, MeshAxis.EDP.value


def refuse_unsupported(plan: Plan) -> None:
    """Raise ``PlanError`` for plan parts this runtime cannot execute, rather than run them wrong."""
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
    if t.chunks > 1 and t.zero_stage > 0:
        # ZeRO's buckets and its reduce-scatter at the last micro-batch follow one chunk per rank
        raise PlanError(f"the plan runs {t.schedule} ({t.chunks} chunks per rank) with ZeRO-{t.zero_stage}: this "
                        f"runtime shards model state under one chunk per rank only",
                        hint="recompile with `partita compile --zero 0`, or with `--schedule 1f1b`")
    if plan.mesh.ep > 1:
        if plan.mesh.tp > 1:
            raise PlanError(f"the plan splits experts over ep={plan.mesh.ep} with tp={plan.mesh.tp}: this runtime "
                            f"splits experts over the data-parallel ranks of a tp=1 mesh only",
                            hint="recompile with `partita compile --ep 1`, or with --tp 1")
        if not plan.nodes:
            raise PlanError(f"the plan has ep={plan.mesh.ep} but no node decisions to find the expert layers by",
                            hint="recompile the plan with `partita compile`")
    recomputing = [s.index for s in plan.stages if s.recompute != NONE]
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
                        "recomputation (`--recompute none`)")


def compose(module: nn.Module, plan: Plan, ctx: DistContext, options: Options, counter: CollectiveCounter) -> Program:
    """Apply a plan's parts to ``module`` for this rank (after checking the plan against the world
    and ``refuse_unsupported``).

    The order, and why:

    1. tensor parallelism: keep this rank's parameter shards and build the
       local program over "tp" (at tp == 1 too when the plan recomputes
       activations, so that recomputation is the program's at every tp).
       First, because every later part must see the parameters as this rank
       holds them.
    2. the pipeline split: keep this rank's stage, built as the TP program
       restricted to the stage's nodes (it holds only its own parameters);
       before data parallelism, so that it wraps only the stage's parameters.
       (1 and 2 are one construction when pp > 1.)
    3. mixed precision: the local parameters cast to the policy's dtype, before
       data parallelism lays out gradient buckets in that dtype.
    4. data parallelism or ZeRO over "dp": the replicas broadcast from dp rank
       0, then gradient averaging hooked, or the model state sharded (ZeRO-3
       gathers parameters per graph node in the TP program, else around each
       module's forward). After 1-3, because it acts on the final local
       parameters; the optimizer is built last of all, on what it updates (and
       the user's LR scheduler over it). The gradient sync is how these parts
       meet in a step (runtime/step/sync.py).
    5. the schedule: the one micro-batch loop (runtime/step/schedule.py) over
       the pipeline's stage and its GPipe / 1F1B order, or over the whole rank
       as a schedule of one stage, drives all of the above.
    """
    plan.check_matches(world_size=ctx.world_size)
    refuse_unsupported(plan)
    loss_fn, optimizer, weights = options.loss, options.optimizer_factory, options.weights
    module = uncompiled(module)  # a torch.compile'd model runs its own forward, as it was captured
    GROUPS.begin()  # this program's groups: those an earlier one made alike are reused
    mesh = build_mesh(plan.mesh, ctx)
    policy = PrecisionPolicy.of(plan.training)
    training = not plan.training.inference
    names = state_names(module)  # read before the plan's parts take the module apart
    keep = kept_whole(module)  # batch norm's parameters stay in their dtype, beside its statistics
    persistent = {k for k, _ in module.named_buffers() if k in module.state_dict(keep_vars=True)}
    dp_mesh = mesh[DP] if mesh is not None and plan.mesh.dp > 1 else None
    dp_group, dp_rank = (dp_mesh.get_group(), dp_mesh.get_local_rank()) if dp_mesh is not None else (None, 0)
    # expert groups ("ep") and the dp ranks holding the same experts ("edp"), core/mesh.py
    ep_group, edp_group = expert_groups(plan.mesh, ctx) if plan.mesh.ep > 1 else (None, None)
    # the dp ranks sharing samples, each holding a slice of every sequence ("cp", runtime/cp/)
    context = (ContextGroup(context_group(plan.mesh, ctx), counter, _sequence(plan), ctx.device)
               if plan.mesh.cp > 1 else None)
    interpreted = (plan.mesh.pp > 1 or plan.mesh.tp > 1 or ep_group is not None or context is not None
                   or any(s.recompute != NONE for s in plan.stages))
    # random ops drawn alike over "tp", apart over "dp" (runtime/rng.py)
    rng = (run_seed(options.seed), dp_rank) if interpreted and ctx.world_size > 1 else None
    graph_loss = loss_fn if training else None  # an inference plan's graph has no loss
    # 1. tensor parallelism and 2. the pipeline split
    pipeline = None
    if plan.mesh.pp > 1:
        local = pipeline = apply_pipeline(module, plan, mesh, loss_fn=graph_loss, counter=counter,
                                          device=ctx.device, precision=policy, rng=rng, weights=weights,
                                          compile=bool(options.compile),
                                          experts=ExpertGroup(ep_group, counter) if ep_group is not None else None,
                                          context=context)
        loss = None  # the stage's schedule runs the micro-batches
    elif interpreted:
        local = apply_tensor_parallel(module, plan, mesh[TP].get_group() if plan.mesh.tp > 1 else None,
                                      loss_fn=graph_loss, counter=counter, device=ctx.device,
                                      precision=policy, rng=rng, weights=weights, compile=bool(options.compile),
                                      experts=ExpertGroup(ep_group, counter) if ep_group is not None else None,
                                      context=context)
        loss = _program_loss(local)
    else:
        if weights is not None:
            load_eager(module, open_weights(weights))
        local = module.to(ctx.device)
        loss = _eager_loss(local, loss_fn, policy, ctx.device, compile=bool(options.compile))
    # 3. mixed precision
    tp_program = tp_module_of(local, pipeline)
    params = ([(n, q) for n, (q, _) in tp_program.local_parameters().items()] if tp_program is not None
              else list(local.named_parameters()))  # by the model's names: what ``keep`` names
    scaler = apply_mixed_precision(params, policy, training=training, keep=keep)
    # 4. ZeRO / data parallelism, and the optimizer
    # a rank's experts differ over "dp": they are made equal over the ranks holding the same ones
    experts = _expert_shards(local, pipeline) if ep_group is not None else []
    if dp_group is not None:
        broadcast_replicas(local, dp_group, apart=experts, apart_group=edp_group)
    buckets = options.bucket_bytes or plan.training.grad_bucket_bytes
    zero = averager = master = opt = None
    offload = plan.training.offload != NO_OFFLOAD  # the optimizer's state and masters in host memory
    if training and dp_group is not None and plan.training.zero_stage > 0:
        zero, averager = _apply_zero(local, pipeline, plan.training.zero_stage, dp_group, optimizer=optimizer,
                                     bucket_bytes=buckets, counter=counter, policy=policy,
                                     zero_units=plan.training.zero_units, order=[p.name for p in plan.params],
                                     offload=offload, experts=_ExpertAveraging(experts, edp_group, plan.mesh.dp))
        opt = zero.optimizer
    elif training:
        if dp_group is not None:
            # without a pipeline the optimizer step reads the mean straight from the reduce (a
            # pipeline first sums tied copies' gradients between its stages, from .grad)
            own = {id(e) for e in experts}
            dense = [q for q in local.parameters() if id(q) not in own]
            averager = _ExpertAveraging(experts, edp_group, plan.mesh.dp).beside(apply_data_parallel(
                dense, dp_group, bucket_bytes=buckets, counter=counter, axis=DP, reduce_dtype=policy.reduce_dtype,
                keep_reduced=pipeline is None), bucket_bytes=buckets, counter=counter, policy=policy,
                keep_reduced=pipeline is None)
        master = MasterWeights([q for q in local.parameters() if q.requires_grad], optimizer, policy,
                               chunk_bytes=buckets, offload=offload)
        opt = master.optimizer
    buffers = (BufferAverager(_local_buffers(local, pipeline), dp_group, counter=counter, axis=DP)
               if training and dp_group is not None else None)
    scheduler = (user_scheduler(options.scheduler, opt)  # the user's LR scheduler, over the one optimizer
                 if options.scheduler is not None and opt is not None else None)
    return Program(plan, ctx, local, loss, opt, averager=averager, zero=zero, dp_group=dp_group, dp_rank=dp_rank,
                   dp_size=plan.mesh.dp if dp_group is not None else 1, pipeline=pipeline, master=master,
                   policy=policy, scaler=scaler, state_names=names, persistent=persistent,
                   sync=_gradient_sync(zero, averager, master, buffers, dp_group), scheduler=scheduler)


def _sequence(plan: Plan) -> int:
    """The sequence length the plan's inputs carry (the dim cp splits, core/axes ``sequence_length``)."""
    from partita.core.axes import sequence_length

    seq = sequence_length(plan.model.inputs)
    if seq is None:
        raise PlanError(f"the plan splits sequences over cp={plan.mesh.cp}, but its inputs "
                        f"({', '.join(plan.model.inputs)}) carry no one sequence length (dim 1)",
                        hint="recompile with --cp 1")
    return seq


def _gradient_sync(zero: ZeroProgram | None, averager: GradientAverager | Averagers | None,
                   master: MasterWeights | None, buffers: BufferAverager | None,
                   dp_group: dist.ProcessGroup | None) -> GradientSync:
    """How step 4's parts meet in a training step (runtime/step/sync.py): ZeRO, with the parameters
    it keeps whole averaged beside it; data parallelism; one replica; or an inference plan's none."""
    if zero is not None:
        return Sharded(zero, averager if averager is not None else Averagers([]), buffers, dp_group)
    if averager is not None:
        return Averaged(averager, master, buffers, dp_group)
    if master is not None:
        return OneReplica(master)
    return GradientSync()


class _ExpertAveraging(NamedTuple):
    """A rank's expert slices and how their gradients are averaged: an expert's gradient already sums
    its expert group's tokens (runtime/experts.py), so summed over the ranks holding the same experts
    ("edp") and divided by all of dp it is the global batch's mean, as every dense gradient is."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    dp: int

    def beside(self, other: GradientAverager | None, *, bucket_bytes: int, counter: CollectiveCounter,
               policy: PrecisionPolicy, keep_reduced: bool = False) -> GradientAverager | Averagers | None:
        """``other`` (the dense or tied parameters' averager), and the experts' beside it."""
        if not self.params:
            return other
        mine = apply_data_parallel(self.params, self.group, bucket_bytes=bucket_bytes, counter=counter, axis=EDP,
                                   reduce_dtype=policy.reduce_dtype, keep_reduced=keep_reduced, divisor=self.dp)
        return mine if other is None else Averagers([other, mine])


def _expert_shards(local: nn.Module, pipeline: PipelineStage | None) -> list[nn.Parameter]:
    """This rank's slices of the parameters stacked over experts (its TP program's ``expert_params``)."""
    program = tp_module_of(local, pipeline)
    if program is None:
        return []
    return [q for name, (q, _) in program.local_parameters().items() if name in program.expert_params]


def _local_buffers(local: nn.Module, pipeline: PipelineStage | None) -> list[torch.Tensor]:
    """The running statistics this rank's training forward writes: by the plan's graph in its TP
    program (a stage's), else the eager module's batch-norm statistics."""
    program = tp_module_of(local, pipeline)
    if program is None:
        return running_statistics(local)
    held = program.buffers_by_node()
    return [held[n] for n in running_buffers(program.graph_module.graph, program.buffer_nodes) if n in held]


def _apply_zero(local: nn.Module, pipeline: PipelineStage | None, stage: int, dp_group: dist.ProcessGroup, *,
                optimizer: OptimizerFactory, bucket_bytes: int, counter: CollectiveCounter,
                policy: PrecisionPolicy, zero_units: tuple[str, ...] = (), order: Sequence[str] = (),
                offload: bool = False, experts: _ExpertAveraging | None = None,
                ) -> tuple[ZeroProgram, GradientAverager | Averagers | None]:
    """ZeRO ``stage`` over ``local``'s parameters, with the one optimizer; and the averager of the
    parameters tied across pipeline stages, which stay whole on each (their copies' gradients are
    summed between the stages, which lay out their ZeRO buckets differently; the optimizer's
    elementwise update is the same), and of the rank's expert slices, which stay whole too (they
    differ over "dp": ``experts``). ``zero_units``: the plan's ZeRO-3 units (core/buckets.py),
    whose buckets follow the parameters in the plan's ``order`` (its ``params``), as it priced them."""
    tied = pipeline.tied_parameters if pipeline is not None else []
    own = experts.params if experts is not None else []
    whole = {id(t) for t in [*tied, *own]}  # kept out of ZeRO's buckets
    named = [(n, q) for n, q in local.named_parameters() if id(q) not in whole]
    units = None
    if stage == 3 and zero_units:
        program = tp_module_of(local, pipeline)
        qualified = ({id(q): n for n, (q, _) in program.local_parameters().items()} if program is not None
                     else {id(q): n for n, q in named})  # the model's names, as the plan's units are
        rank = {n: i for i, n in enumerate(order)}
        named.sort(key=lambda nq: rank.get(qualified[id(nq[1])], len(rank)))
        units = [unit_of(qualified[id(q)], zero_units) for _, q in named]
    zero = apply_zero(named, stage, dp_group, optimizer_factory=optimizer, bucket_bytes=bucket_bytes,
                      counter=counter, axis=DP, precision=policy, extra_params=[*tied, *own], units=units,
                      offload=offload)
    averager = apply_data_parallel(tied, dp_group, bucket_bytes=bucket_bytes, counter=counter, axis=DP,
                                   reduce_dtype=policy.reduce_dtype) if tied else None
    if experts is not None:
        averager = experts.beside(averager, bucket_bytes=bucket_bytes, counter=counter, policy=policy)
    if stage == 3:
        program = tp_module_of(local, pipeline)
        if program is not None:
            program.param_access = zero  # each graph node gathers what it reads
        else:
            zero.install_module_hooks(local)  # the eager path: around each module's forward
    return zero, averager


def _program_loss(program: TensorParallel) -> MicroBatchLoss:
    def loss(xs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        return program(*xs, targets=y)

    return loss


def _eager_loss(module: nn.Module, loss_fn: LossFn, policy: PrecisionPolicy, device: torch.device, *,
                compile: bool = False) -> MicroBatchLoss:
    def loss(xs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
        with policy.autocast(device):  # the precision policy's forward (runtime/mixed_precision.py)
            return training_loss(loss_fn, module, xs, y)

    return compiled(loss, "the rank's model and loss") if compile else loss


def user_scheduler(factory: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer) -> Any:
    """``scheduler=``'s scheduler over this run's optimizer, or one message: a scheduler class given
    for a factory, a factory that fails on the optimizer or returns no scheduler, or a scheduler over
    another optimizer (it would leave this run's learning rate untouched)."""
    hint = "pass a factory of this run's optimizer: scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 100)"
    if isinstance(factory, type):
        raise PartitaError(f"scheduler= got the class {factory.__name__}, not a factory of the optimizer: partita "
                           "builds the optimizer, so it builds the scheduler over it", hint=hint)
    try:
        scheduler = factory(optimizer)
    except Exception as e:  # the user's factory (or torch's scheduler) refusing this optimizer
        raise PartitaError(f"scheduler= failed on the run's optimizer ({type(optimizer).__name__}): "
                           f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", hint=hint) from None
    if isinstance(scheduler, torch.optim.Optimizer) or not callable(getattr(scheduler, "step", None)):
        # an optimizer has a step() too: stepped as the scheduler, it would update the parameters twice a step
        raise PartitaError(f"scheduler= returned {type(scheduler).__name__ if scheduler is not None else 'None'}, "
                           "not a scheduler (something with step() that sets the learning rate)", hint=hint)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise PartitaError("scheduler= returned a scheduler over another optimizer: this run's learning rate would "
                           "never change", hint="build it over the optimizer the factory is given, not one of your own")
    needs = _required_arguments(scheduler.step)
    if needs:  # ReduceLROnPlateau.step(metrics): partita steps the scheduler after each optimizer step, bare
        raise PartitaError(f"scheduler= returned {type(scheduler).__name__}, whose step() needs {', '.join(needs)}: "
                           "partita calls scheduler.step() with no argument after each optimizer step",
                           hint="pass a scheduler stepped by the step count (StepLR, CosineAnnealingLR, LambdaLR, "
                           "...), or step one that needs a metric in your own loop")
    bad = next((lr for lr in (_number(g.get("lr")) for g in optimizer.param_groups)
                if lr is not None and not (math.isfinite(lr) and lr >= 0)), None)
    if bad is not None:
        raise PartitaError(f"scheduler= set the learning rate to {bad}: a learning rate is a finite number >= 0",
                           hint="check the scheduler's factor or lambda at step 0")
    return scheduler


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _required_arguments(method: Callable[..., Any]) -> list[str]:
    """The parameters ``method`` cannot be called without (none for a scheduler partita steps)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume it takes none
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
