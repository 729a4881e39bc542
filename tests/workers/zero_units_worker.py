"""What each rank of the ZeRO-3-units test measures (test_zero_units.py asserts it): the planner's
dp=2 ZeRO-3 plan of the example GPT run for three steps next to one process; the plan's units, the
buckets the runtime made, how many gathers each step started ahead of their use (prefetches), the
ZeRO collectives of the last step against the plan's list, the losses and the parameters after."""

from __future__ import annotations

import copy

import torch

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, plans_spread, reference_step
from tests.workers.dp_worker import OPTIMIZERS, SEQ, gpt_batch, gpt_loss

STEPS, BATCH = 3, 8


def _plan():
    return compile_model(gpt_tiny, Options(inputs=[f"idx=int64[{BATCH},{SEQ}]"], cluster="local", devices=2,
                                           world_size=2, dp=2, zero=3, loss=gpt_loss)).plan


def run(ctx: DistContext) -> dict:
    plan, = plans_spread(ctx, [_plan])  # made on rank 0 alone, given to both
    if isinstance(plan, Exception):
        raise plan
    torch.manual_seed(0)
    reference = gpt_tiny()
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]),
                          ctx=ctx)
    zero = model._program.zero
    started = [0]
    prefetch = zero._prefetch

    def counted(b):  # a prefetch that starts a gather
        if b is not None and b.gathering is None and b.params_flat.untyped_storage().nbytes() == 0:
            started[0] += 1
        prefetch(b)

    zero._prefetch = counted
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(BATCH)
    losses, ref_losses, prefetched = [], [], []
    for _ in range(STEPS):
        started[0] = 0
        losses.append(float(model.train_step(x, targets=y)))
        prefetched.append(started[0])
        ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y,
                                         micro_batch=plan.training.micro_batch_size))
    calls = sorted([k, b, c] for (k, axis, b), c in model.collectives.calls.items()
                   if axis == "dp" and k in ("reduce_scatter", "all_gather"))
    planned = sorted([c.kind, c.bytes, c.count] for c in plan.collectives
                     if c.kind in ("reduce_scatter", "all_gather"))
    full = model.full_state_dict(buffers=False)
    return {"units": list(plan.training.zero_units), "buckets": len(zero.buckets), "prefetched": prefetched,
            "calls": calls, "planned_calls": planned, "losses": losses, "ref_losses": ref_losses,
            "params": gaps(full, dict(reference.named_parameters()))}
