"""What each rank of the ``compile=True`` tests measures (test_compile.py asserts it).

The example GPT (2 layers) on the planner's plans, trained with ``Options(compile=True)`` next to
one process training the same model from the same weights on the same global batch:

- ``tp2``: the planner's tp=2 plan over both ranks (its reshards are collectives, where
  ``torch.compile`` breaks the graph);
- ``recompute``: a one-process plan recomputing every layer (on rank 0 only; a program the
  compiler takes whole).

Each returns the losses of every step and the parameters' distance after the last, and what the
rank printed about compiling.
"""

from __future__ import annotations

import contextlib
import copy
import io

import torch

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.dp_worker import OPTIMIZERS, SEQ, gpt_batch, gpt_loss
from tests.harness import gaps, reference_step

STEPS, BATCH = 2, 8


def _run(ctx: DistContext, pins: dict, world: int) -> dict:
    plan = compile_model(gpt_tiny, Options(inputs=[f"idx=int64[{BATCH},{SEQ}]"], cluster="local", devices=world,
                                           world_size=world, loss=gpt_loss, **pins)).plan
    torch.manual_seed(0)
    reference = gpt_tiny()
    model = ParallelModel(copy.deepcopy(reference), plan,
                          Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"], compile=True), ctx=ctx)
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(BATCH)
    losses, ref_losses = [], []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(STEPS):
            losses.append(float(model.train_step(x, targets=y)))
            ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y,
                                             micro_batch=plan.training.micro_batch_size))
    full = model.full_state_dict(buffers=False)
    return {"mesh": str(plan.mesh), "losses": losses, "ref_losses": ref_losses,
            "params": gaps(full, dict(reference.named_parameters())),
            "printed": [line for line in printed.getvalue().splitlines() if "torch.compile" in line]}


def run(ctx: DistContext) -> dict:
    out = {"tp2": _run(ctx, {"tp": 2}, 2)}
    if ctx.rank == 0:
        single = DistContext(0, 1, 0, "none", torch.device("cpu"), False)
        out["recompute"] = _run(single, {"recompute": True}, 1)
    return out
