"""What each rank of test_buffers.py measures (the test asserts it): batch norm's running
statistics under data parallelism.

A dp=2 plan of the example CNN (two BatchNorm2d layers) trains STEPS steps. Each replica's
running statistics come from its half of the batch; after every step the runtime averages them
over "dp". The expected values are worked by hand from the rule: from the same starting
statistics, each dp share's micro-batches run through a copy of the reference model in train
mode, in order (batch norm's update per forward), and the two results are averaged; the
reference then takes its step on the whole batch (its parameters are the ranks' too). Also: whether
the statistics are bit-equal on both ranks, ``full_state_dict``'s beside them and whether it loads
strictly into one process, and the all-reduces the runtime ran beside those the plan lists.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from examples.models import SmallCNN
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.plans.verify import load_plan
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, reference_step
from tests.workers.dp_worker import OPTIMIZERS, raised

STEPS = 2


def batches(global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(global_batch, 3, 32, 32, generator=g) * (1 + k) + k,
             torch.randint(0, 10, (global_batch,), generator=g))
            for k in range(STEPS)]


def _stats(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if "running" in k}


@torch.no_grad()
def expected_stats(reference: torch.nn.Module, x: torch.Tensor, dp: int, micro_batch: int
                   ) -> dict[str, torch.Tensor]:
    """The rule, by hand: each share's micro-batches through a copy in train mode, then the mean."""
    per_share = []
    for share in x.chunk(dp):
        copy_ = copy.deepcopy(reference).train()
        for i in range(0, share.shape[0], micro_batch):
            copy_(share[i:i + micro_batch])
        per_share.append(_stats(copy_))
    return {k: sum(s[k] for s in per_share) / dp for k in per_share[0]}


def run(ctx: DistContext, plan_path: str) -> dict:
    plan = load_plan(plan_path, world_size=ctx.world_size)
    tr = plan.training
    torch.manual_seed(5)
    reference = SmallCNN()
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=default_loss, optimizer=OPTIMIZERS["sgd"]),
                          ctx=ctx)
    opt = OPTIMIZERS["sgd"](reference.parameters())
    stats = []  # each step's running statistics against the rule's
    for x, y in batches(tr.global_batch):
        want = expected_stats(reference, x, plan.mesh.dp, tr.micro_batch_size)
        model.train_step(x, targets=y)
        reference_step(reference, opt, default_loss, x, y, micro_batch=tr.micro_batch_size)
        reference.load_state_dict({**reference.state_dict(), **want})  # the ranks' rule, for the next step
        stats.append(gaps(_stats(model.module), want))
    counted = [list(c) for c in model.collectives.as_tuples()]
    mine = torch.cat([v.flatten() for v in _stats(model.module).values()])
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine)
    state = model.full_state_dict()
    one = SmallCNN()
    planned = [[c.kind, c.axis, c.bytes, c.count] for c in plan.collectives if "running statistics" in c.purpose]
    return {"stats": stats, "replicas_agree": all(torch.equal(e, every[0]) for e in every),
            # parameters and buffers: everything one process needs (the message if it does not load)
            "strict_load_refused": raised(lambda: one.load_state_dict(state, strict=True), RuntimeError),
            "saved_stats": gaps({k: v for k, v in state.items() if "running" in k}, _stats(model.module)),
            "counted": counted, "planned": planned, "moved": float((state["bn1.running_mean"]).abs().max())}
