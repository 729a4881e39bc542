"""``@partita.parallelize``: the one line a user adds.

    @partita.parallelize(inputs={"idx": "int64[16,64]"}, cluster="local")
    class GPT(nn.Module): ...

    model = GPT(config)                      # plain model outside torchrun
    loss = model.train_step(idx, targets=y)  # the same call whatever the plan

Under torchrun every rank builds the model; rank 0 captures and plans (or
loads and checks ``plan=``) and sends the plan to the others as JSON, then
each rank runs its part of it. Outside torchrun the same object trains in
one process, so a script runs unchanged both ways.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from partita.core.errors import PartitaError
from partita.core.inputs import InputSpec, parse_input_spec
from partita.core.losses import default_loss, resolve_loss
from partita.core.plan import Plan
from partita.core.verify import load_plan, verified_plan

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]




def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW at lr 1e-3, fused where torch has a fused kernel for the parameters' device (CPU and
    CUDA do): one pass over the optimizer state, as the cost model prices the step
    (passes/cost_model.py ``optimizer_time``), where the default foreach step makes several (on
    this machine 2.6 ms against 17.8 ms for 3.7M fp32 parameters)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    except RuntimeError:  # a device or dtype torch has no fused AdamW for
        return torch.optim.AdamW(params, lr=1e-3)


def optimizer_kind(factory: OptimizerFactory) -> str:
    """The cost model's name for what ``factory`` builds (probed on a one-element parameter)."""
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    if isinstance(probe, torch.optim.AdamW):
        return "adamw"
    if isinstance(probe, torch.optim.Adam):
        return "adam"
    if isinstance(probe, torch.optim.SGD):
        return "sgd-momentum" if probe.defaults.get("momentum", 0) else "sgd"
    raise PartitaError(
        f"optimizer {type(probe).__name__} has no memory model yet",
        hint="use torch.optim.AdamW, Adam or SGD",
    )


def _parse_inputs(inputs: Mapping[str, str] | Sequence[str] | None) -> tuple[InputSpec, ...]:
    if inputs is None:
        return ()
    if isinstance(inputs, Mapping):
        return tuple(parse_input_spec(f"{k}={v}") for k, v in inputs.items())
    return tuple(parse_input_spec(s) for s in inputs)


@dataclass(frozen=True)
class ParallelizeSpec:
    """Everything the decorator was given; `partita compile` reads it too."""

    inputs: tuple[InputSpec, ...] = ()
    cluster: str = "local"
    nodes: int | None = None
    devices: int | None = None
    batch: int | None = None
    precision: str | None = None
    optimizer: OptimizerFactory = default_optimizer
    loss: Callable[[Any, torch.Tensor], torch.Tensor] = default_loss
    plan: str | None = None
    pins: Mapping[str, int | str | bool] = field(default_factory=dict)
    targets: InputSpec | None = None  # the loss's targets, when the output does not imply them
    watchdog_s: float | None = None  # runtime/watchdog.py; None: PARTITA_WATCHDOG_S or its default
    checkpoint_dir: str | None = None  # runtime/state/sharded.py; None: PARTITA_CHECKPOINT_DIR
    checkpoint_every: int | None = None
    weights: str | None = None  # pretrained weights (torch.save or .safetensors), each rank reading its part
    check_replicas_every: int | None = None  # runtime/rng.py; None: PARTITA_CHECK_REPLICAS_EVERY (0: off)
    max_grad_norm: float | None = None  # clip the global gradient norm (recorded in the plan)
    reduce_dtype: str = "fp32"  # gradients reduced over dp in this dtype (core/precision.py)


class Parallelized:
    """A model class or factory wrapped by ``@parallelize``: calling it builds a ParallelModel."""

    def __init__(self, target: Callable[..., torch.nn.Module], spec: ParallelizeSpec) -> None:
        self.target = target
        self.spec = spec
        functools.update_wrapper(self, target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _wrap(self.target(*args, **kwargs), self.spec)

    def __repr__(self) -> str:
        return f"partita.parallelize({getattr(self.target, '__name__', self.target)!r})"


def parallelize(
    target: Any = None,
    /,
    *,
    inputs: Mapping[str, str] | Sequence[str] | None = None,
    cluster: str = "local",
    nodes: int | None = None,
    devices: int | None = None,
    batch: int | None = None,
    precision: str | None = None,
    optimizer: OptimizerFactory | None = None,
    loss: Callable[[Any, torch.Tensor], torch.Tensor] | str | None = None,
    output: str | int | None = None,
    targets: str | None = None,
    plan: str | None = None,
    dp: int | None = None,
    tp: int | None = None,
    pp: int | None = None,
    zero: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    recompute: bool | None = None,
    watchdog_s: float | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    weights: str | None = None,
    check_replicas_every: int | None = None,
    max_grad_norm: float | None = None,
    reduce_dtype: str = "fp32",
) -> Any:
    """Plan and run ``target`` in parallel.

    On a class or factory (as a decorator) it returns a ``Parallelized``
    that builds the model, plans it and wraps it; on an ``nn.Module``
    instance it wraps that instance directly. ``inputs`` are example inputs
    as ``{"name": "dtype[shape]"}`` (their leading dim is the global batch
    unless ``batch`` says otherwise); ``plan`` is a plan file to use instead
    of planning. ``loss`` is a function ``(output, targets) -> loss``, a name
    ("cross-entropy", "mse") or "model" (the model's own loss, called with
    ``labels=targets``); ``output`` names the field (or tuple index) of what the
    model returns that the loss attaches to (default: ``logits``, else the only
    tensor); ``targets`` ("NAME=DTYPE[SHAPE]") when the output does not imply them. ``dp``, ``tp``, ``pp``, ``zero``, ``micro_batch_size``,
    ``microbatches`` (or its other name ``grad_accum_steps``), ``schedule`` and
    ``recompute`` (activation recomputation on every stage, or never) pin those decisions (the same keywords as `partita compile`); the planner
    decides the rest. ``watchdog_s`` bounds how long a step may wait in a collective before
    every rank reports what it waits in and the job exits (default 300 s or
    ``PARTITA_WATCHDOG_S``; 0 turns the watchdog off). ``checkpoint_dir`` and
    ``checkpoint_every`` save a sharded checkpoint every N steps, and a run that finds a complete
    one in ``checkpoint_dir`` resumes from it (``model.step`` says where). ``weights`` starts from
    pretrained weights (a ``torch.save``d state dict or a ``.safetensors`` file, the unwrapped
    model's names), each rank reading only the tensors (under TP, the pages of the slices) it holds.
    """
    if checkpoint_every is not None and (isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
                                         or checkpoint_every < 1):
        raise PartitaError(f"checkpoint_every={checkpoint_every!r} must be a whole number of steps >= 1",
                           hint="e.g. checkpoint_every=100, or leave it out for no periodic checkpoint")
    if checkpoint_every is not None and checkpoint_dir is None:
        raise PartitaError("checkpoint_every needs checkpoint_dir: where should the checkpoints go?",
                           hint="pass checkpoint_dir='DIR' too (or `partita run --checkpoint-dir DIR`)")
    if watchdog_s is not None and not (isinstance(watchdog_s, (int, float)) and 0 <= watchdog_s < float("inf")):
        raise PartitaError(f"watchdog_s={watchdog_s!r} must be a number of seconds >= 0 (0 turns it off)",
                           hint="e.g. watchdog_s=600, or leave it out for the default (300 s)")
    if microbatches is not None and grad_accum_steps not in (None, microbatches):
        raise PartitaError(f"microbatches={microbatches} and grad_accum_steps={grad_accum_steps} disagree",
                           hint="they are the same decision; pass one")
    pins = {k: v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("zero_stage", zero),
                               ("micro_batch_size", micro_batch_size),
                               ("grad_accum_steps", grad_accum_steps or microbatches),
                               ("schedule", schedule), ("recompute", recompute)) if v is not None}
    _check_keywords(pins, cluster=cluster, nodes=nodes, devices=devices, batch=batch, precision=precision,
                    reduce_dtype=reduce_dtype, max_grad_norm=max_grad_norm)
    spec = ParallelizeSpec(
        inputs=_parse_inputs(inputs), cluster=cluster, nodes=nodes, devices=devices, batch=batch,
        precision=precision, optimizer=optimizer or default_optimizer, loss=resolve_loss(loss, output),
        targets=parse_input_spec(targets if "=" in targets else f"targets={targets}") if targets else None,
        plan=plan, pins=pins, watchdog_s=watchdog_s, checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every, weights=weights, check_replicas_every=check_replicas_every,
        max_grad_norm=max_grad_norm, reduce_dtype=reduce_dtype,
    )
    if target is None:
        return lambda t: parallelize(t, **_spec_kwargs(spec))
    if isinstance(target, torch.nn.Module):
        return _wrap(target, spec)
    if callable(target):
        return Parallelized(target, spec)
    raise PartitaError(f"parallelize() takes an nn.Module, a model class or a factory, not {type(target).__name__}",
                       hint="decorate the model class (@partita.parallelize(...)) or pass a built model")


def _check_keywords(pins: dict[str, Any], *, cluster: str, nodes: int | None, devices: int | None,
                    batch: int | None, precision: str | None, reduce_dtype: str, max_grad_norm: float | None) -> None:
    """Refuse a bad keyword where ``parallelize(...)`` is written, by the checks `partita compile`
    makes of the same options (the pins, the cluster, the training set-up), not when the model is
    first built."""
    from partita.core.cluster import load_cluster
    from partita.passes.constraints import Pins, TrainingRequest

    Pins(**pins)
    load_cluster(cluster, nodes=nodes, devices=devices)
    TrainingRequest(global_batch=batch if batch is not None else 1, precision=precision or "fp32",
                    reduce_dtype=reduce_dtype, max_grad_norm=max_grad_norm)


def _spec_kwargs(spec: ParallelizeSpec) -> dict[str, Any]:
    return dict(
        inputs=[str(s) for s in spec.inputs], cluster=spec.cluster, nodes=spec.nodes, devices=spec.devices,
        batch=spec.batch, precision=spec.precision, optimizer=spec.optimizer, loss=spec.loss, plan=spec.plan,
        targets=str(spec.targets) if spec.targets else None,
        watchdog_s=spec.watchdog_s, checkpoint_dir=spec.checkpoint_dir, checkpoint_every=spec.checkpoint_every,
        weights=spec.weights, check_replicas_every=spec.check_replicas_every,
        max_grad_norm=spec.max_grad_norm, reduce_dtype=spec.reduce_dtype,
        **{("zero" if k == "zero_stage" else k): v for k, v in spec.pins.items()},
    )


def plan_for(module: torch.nn.Module, spec: ParallelizeSpec, world_size: int) -> Plan:
    """Compile (or load and check) the plan for ``module`` on ``world_size`` processes."""
    from partita.core.capture import capture
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.passes.constraints import Pins
    from partita.core.graph import graph_fingerprint, to_networkx

    launched = os.environ.get("PARTITA_PLAN")
    if spec.plan and launched and not _same_file(spec.plan, launched):
        raise PartitaError(f"the script asks for plan {spec.plan}, but `partita run` was given {launched}",
                           hint="drop plan= from parallelize(...) to run what `partita run` is given, "
                           "or run that plan")
    plan_path = spec.plan or launched
    if plan_path:
        plan = load_plan(plan_path, world_size=world_size)
        specs = tuple(parse_input_spec(s) for s in plan.model.inputs)
        targets = parse_input_spec(plan.model.targets) if plan.model.targets else None
        captured = capture(module, specs, loss=spec.loss if plan.model.loss else None, targets=targets)
        fingerprint = graph_fingerprint(to_networkx(captured))
        plan.check_matches(fingerprint=fingerprint)
        return plan
    if not spec.inputs:
        raise PartitaError(
            "parallelize() needs example inputs to plan, e.g. inputs={'idx': 'int64[16,64]'}",
            hint="or pass plan='PLAN.json' made by `partita compile`",
        )
    cluster = load_cluster(spec.cluster, nodes=spec.nodes, devices=spec.devices)
    if cluster.name == "local" and world_size > cluster.world_size:
        cluster = cluster.with_devices(world_size)
    return compile_model(
        module, spec.inputs, cluster, global_batch=spec.batch, precision=spec.precision,
        optimizer=optimizer_kind(spec.optimizer), pins=Pins(world_size=world_size, **spec.pins), loss=spec.loss,
        targets=spec.targets, max_grad_norm=spec.max_grad_norm, reduce_dtype=spec.reduce_dtype,
    ).plan


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _wrap(module: torch.nn.Module, spec: ParallelizeSpec) -> Any:
    from partita.runtime.distributed import init_distributed
    from partita.runtime.engine import apply_plan

    ctx = init_distributed(watchdog_s=spec.watchdog_s)
    if ctx.world_size == 1:
        plan = plan_for(module, spec, 1)
    else:
        # Rank 0 plans; the others receive the plan file's JSON text (never a pickle).
        text = ""
        if ctx.rank == 0:
            try:
                text = plan_for(module, spec, ctx.world_size).to_json()
            except PartitaError as e:
                text = json.dumps({"error": str(e)})
        data = json.loads(_broadcast_text(text, ctx.device))
        if "error" in data:
            raise PartitaError(f"rank 0 could not plan: {data['error']}", hint="rank 0's message above says what to fix")
        plan = verified_plan(data, source="plan from rank 0")
    return apply_plan(module, plan, loss_fn=spec.loss, optimizer=spec.optimizer, ctx=ctx,
                      watchdog_s=spec.watchdog_s, checkpoint_dir=spec.checkpoint_dir,
                      checkpoint_every=spec.checkpoint_every, checkpoint=spec.weights,
                      check_replicas_every=spec.check_replicas_every)


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank, sent as bytes in a tensor."""
    import torch.distributed as dist

    raw = torch.frombuffer(bytearray(text.encode()) or bytearray(1), dtype=torch.uint8).to(device)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = raw if dist.get_rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes().decode()
