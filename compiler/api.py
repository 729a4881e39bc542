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
from collections.abc import Callable
from typing import Any

import torch

from partita.core.errors import PartitaError
from partita.core.files import same_file
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options, environment_option
from partita.core.plans.plan import Plan
from partita.core.plans.verify import load_plan, verified_plan


class NotAModel(PartitaError, AttributeError):
    """A model's attribute asked of a ``Parallelized`` builder (an AttributeError too, so that
    ``getattr(builder, name, default)`` still answers the default)."""


class Parallelized:
    """A model class or factory wrapped by ``parallelize``: calling it builds the model, plans it
    and wraps it (a ``ParallelModel``)."""

    def __init__(self, target: Callable[..., torch.nn.Module], options: Options) -> None:
        self.target = target
        self.options = options
        functools.update_wrapper(self, target)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _wrap(self.target(*args, **kwargs), self.options)

    def __getattr__(self, name: str) -> Any:
        # only reached for names the wrapper lacks: a model's (train_step, parameters, ...)
        if name.startswith("__") or name in ("target", "options"):
            raise AttributeError(name)
        what = getattr(self.target, "__name__", "the factory")
        raise NotAModel(f"parallelize({what}, ...) returned a builder, not a model: it has no {name!r}",
                           hint=f"call it to build the model (model = {what}(...) when decorated, or "
                           f"parallelize({what}, ...)()), or pass a built model: parallelize({what}(), ...)")

    def __repr__(self) -> str:
        return f"partita.parallelize({getattr(self.target, '__name__', self.target)!r})"


def parallelize(target: Any = None, /, options: Options | None = None, **keywords: Any) -> Any:
    """Plan and run ``target`` in parallel: a decorator, or a call.

    ``@partita.parallelize(inputs=..., ...)`` on a model class or factory, or
    ``partita.parallelize(make_model, inputs=...)``, returns a builder: calling it builds the
    model, plans it and wraps it. On an ``nn.Module`` instance, ``partita.parallelize(model,
    inputs=...)`` returns the wrapped model at once. The keywords are ``partita.Options``'
    fields (or pass ``options=Options(...)``): ``inputs`` (``{"name": "dtype[shape]"}``, whose
    leading dim is the global batch unless ``batch`` says otherwise), ``cluster``, ``plan`` (a
    plan file to run instead of planning), ``loss`` and ``output``, ``optimizer`` (a factory of
    parameters), the pins (``dp``, ``tp``, ``pp``, ``zero``, ``micro_batch_size``,
    ``microbatches``, ``schedule``, ``recompute``: the same as `partita compile`'s flags), and
    how it runs (``weights``, ``checkpoint_dir``, ``checkpoint_every``, ``watchdog_s``, ...).
    Every keyword is checked here, where it is written.
    """
    opts = Options.of(options, **keywords)
    opts.cluster_spec()  # an unknown cluster or a bad cluster file is refused here too
    if target is None:
        return lambda t: parallelize(t, opts)
    if isinstance(target, Parallelized):
        raise PartitaError(f"{target!r} is parallelized already",
                           hint="pass the model class, factory or instance itself to parallelize()")
    if isinstance(target, torch.nn.Module):
        return _wrap(target, opts)
    if callable(target):
        return Parallelized(target, opts)
    raise PartitaError(f"parallelize() takes an nn.Module, a model class or a factory, not {type(target).__name__}",
                       hint="decorate the model class (@partita.parallelize(...)) or pass a built model")


def plan_for(module: torch.nn.Module, options: Options, world_size: int) -> Plan:
    """Compile (or load and check) the plan for ``module`` on ``world_size`` processes."""
    from partita.compiler.compile import compile_model
    from partita.core.model.capture import capture
    from partita.core.model.graph import graph_fingerprint, to_networkx

    plan_path = options.plan  # plan= or, left out, the one `partita run` gives (PARTITA_PLAN)
    if plan_path:
        from partita.compiler import elastic

        if elastic.elastic() and load_plan(plan_path).world_size != world_size:  # a node lost or back
            return elastic.replan(module, load_plan(plan_path), options, world_size)
        plan = load_plan(plan_path, world_size=world_size)
        specs = tuple(parse_input_spec(s) for s in plan.model.inputs)
        targets = parse_input_spec(plan.model.targets) if plan.model.targets else None
        captured = capture(module, specs, loss=options.loss if plan.model.loss else None, targets=targets)
        fingerprint = graph_fingerprint(to_networkx(captured))
        plan.check_matches(fingerprint=fingerprint)
        return plan
    if not options.inputs:
        raise PartitaError(
            "parallelize() needs example inputs to plan, e.g. inputs={'idx': 'int64[16,64]'}",
            hint="or pass plan='PLAN.json' made by `partita compile`",
        )
    cluster = options.cluster_spec()
    if cluster.name == "local" and world_size > cluster.world_size:
        cluster = cluster.with_devices(world_size)
    return compile_model(module, options.replace(cluster=cluster, nodes=None, devices=None,
                                                 world_size=world_size)).plan


def _wrap(module: torch.nn.Module, options: Options) -> Any:
    from partita.runtime.distributed import init_distributed
    from partita.runtime.engine import apply_plan

    # first: under torchrun a refusal from here on is one message (runtime/distributed.py); the
    # watchdog's limit is the keyword's, else PARTITA_WATCHDOG_S's
    ctx = init_distributed(watchdog_s=options.watchdog_s)
    launched = environment_option("plan")  # the plan `partita run` was given
    if options.plan and launched and not same_file(options.plan, launched):
        raise PartitaError(f"the script asks for plan {options.plan}, but `partita run` was given {launched}",
                           hint="drop plan= from parallelize(...) to run what `partita run` is given, "
                           "or run that plan")
    options = options.with_environment()  # what `partita run` passes the ranks, checked as keywords are
    if ctx.world_size == 1:
        plan = plan_for(module, options, 1)
    else:
        # Rank 0 plans; the others receive the plan file's JSON text (never a pickle).
        text = ""
        if ctx.rank == 0:
            try:
                text = plan_for(module, options, ctx.world_size).to_json()
            except PartitaError as e:
                text = json.dumps({"error": str(e)})
        data = json.loads(_broadcast_text(text, ctx.device))
        if "error" in data:
            raise PartitaError(f"rank 0 could not plan: {data['error']}",
                               hint="rank 0's message above says what to fix")
        plan = verified_plan(data, source="plan from rank 0")
    return apply_plan(module, plan, options, ctx=ctx)


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank, sent as bytes in a tensor."""
    import torch.distributed as dist

    raw = torch.frombuffer(bytearray(text.encode()) or bytearray(1), dtype=torch.uint8).to(device)
    size = torch.tensor([raw.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = raw if dist.get_rank() == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    return buf.cpu().numpy().tobytes().decode()
