"""The collectives a step runs against the plan's list (tests/integration/test_collective_counts.py).

Each case plans a small model with some axes pinned, trains two steps and returns, for the second
step, what the rank ran and what the plan lists for its stage: calls by (kind, axis), and calls by
(kind, axis, bytes per call).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch

from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import plans_spread
from tests.workers import expert_worker
from tests.workers.any_model_worker import _optimizer

SEQ = {"gpt": 16, "mixtral": 8}
SPEC = {"gpt": "idx=int64[4,16]", "mixtral": "input_ids=int64[4,8]"}


def gpt() -> torch.nn.Module:
    from examples.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=128))  # wide enough that tp splits


FACTORIES = {"gpt": gpt, "mixtral": expert_worker.mixtral}


def _options(world: int, name: str, pins: dict) -> Options:
    return Options(inputs=[SPEC[name]], cluster="local", devices=world, world_size=world, optimizer=_optimizer,
                   log_every=0, **pins)


def _plan(world: int, name: str, pins: dict) -> Any:
    return compile_model(FACTORIES[name], _options(world, name, pins), name=name).plan


def case(ctx: DistContext, plan: Any, name: str, pins: dict) -> dict:
    """One case, given its plan."""
    options = _options(ctx.world_size, name, pins)
    model = ParallelModel(FACTORIES[name](), plan, options, ctx=ctx)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step's: the first also runs the batch check and the first-run shape checks
        idx = torch.randint(0, 64, (plan.training.global_batch, SEQ[name] + 1), generator=g)
        model.collectives.reset()
        model.train_step(idx[:, :-1], targets=idx[:, 1:])
    stage = plan.mesh.stage_of(ctx.rank)
    ran, planned = Counter(), Counter()
    for (kind, axis, nbytes), n in model.collectives.calls.items():
        ran[f"{kind}/{axis}/{nbytes}"] += n
    for c in plan.collectives:
        if c.stage in (None, stage):
            planned[f"{c.kind}/{c.axis}/{c.bytes}"] += c.count
    return {"case": f"{name} {pins}", "ran": dict(ran), "planned": dict(planned)}


def run(ctx: DistContext, cases: list[tuple[str, dict]]) -> list[dict]:
    """Every case's plan, each made on one of the ranks (``plans_spread``), then each case in turn."""
    plans = plans_spread(ctx, [functools.partial(_plan, ctx.world_size, name, pins) for name, pins in cases])
    for p in plans:
        if isinstance(p, Exception):
            raise p
    return [case(ctx, plan, name, pins) for plan, (name, pins) in zip(plans, cases)]
