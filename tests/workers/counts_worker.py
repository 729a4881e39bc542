"""The collectives a step runs against the plan's list (tests/integration/test_collective_counts.py).

Each case plans a small model with some axes pinned, trains two steps and returns, for the second
step, what the rank ran and what the plan lists for its stage: calls by (kind, axis), and calls by
(kind, axis, bytes per call).
"""

from __future__ import annotations

from collections import Counter

import torch

from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.workers import expert_worker
from tests.workers.any_model_worker import _optimizer

SEQ = {"gpt": 16, "mixtral": 8}
SPEC = {"gpt": "idx=int64[4,16]", "mixtral": "input_ids=int64[4,8]"}


def gpt() -> torch.nn.Module:
    from examples.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=128))  # wide enough that tp splits


FACTORIES = {"gpt": gpt, "mixtral": expert_worker.mixtral}


def case(ctx: DistContext, name: str, pins: dict) -> dict:
    options = Options(inputs=[SPEC[name]], cluster="local", devices=ctx.world_size, world_size=ctx.world_size,
                      optimizer=_optimizer, log_every=0, **pins)
    plan = compile_model(FACTORIES[name], options, name=name).plan
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
    return [case(ctx, name, pins) for name, pins in cases]
