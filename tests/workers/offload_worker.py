"""What each rank of the optimizer-offload tests measures (test_offload.py asserts it).

Each case runs a test plan (tests/pp_choice.py's cuts, from zero_mesh_worker.mesh_case) twice
with AdamW, with the optimizer's state on the device and with ``training.offload = "optimizer"``,
beside one process on the same global batch, and returns: the offloaded run's losses and final
parameters against the reference and against the run without offload (in fp32 the offloaded step
is the same arithmetic on a copy of the parameters, so the two agree exactly), where the masters
and the optimizer's state live, and that the masters are copies apart from the parameters.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from partita.core.optimizers import OFFLOAD_OPTIMIZER
from partita.core.options import Options
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, reference_step
from tests.workers.dp_worker import OPTIMIZERS, gpt_batch, gpt_loss
from tests.workers.zero_mesh_worker import mesh_case

STEPS = 3


def compare(ctx: DistContext, name: str, *, dp: int = 1, pp: int = 1, zero: int = 0, cuts_at: tuple[int, ...] = (),
            schedule: str = "1f1b", accum: int = 2) -> dict:
    reference, plan, _ = mesh_case(name, pp=pp, tp=1, dp=dp, cuts_at=cuts_at, schedule=schedule, accum=accum)
    plan = dataclasses.replace(plan, training=dataclasses.replace(plan.training, zero_stage=zero))
    offloaded = dataclasses.replace(plan, training=dataclasses.replace(plan.training, offload=OFFLOAD_OPTIMIZER))
    options = Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"])
    model = ParallelModel(copy.deepcopy(reference), offloaded, options, ctx=ctx)
    plain = ParallelModel(copy.deepcopy(reference), plan, options, ctx=ctx)
    master = model._program.updates
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(plan.training.global_batch)
    losses, plain_losses, ref_losses = [], [], []
    for _ in range(STEPS):
        losses.append(model.train_step(x, targets=y))
        plain_losses.append(plain.train_step(x, targets=y))
        ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y))
    final = model.full_state_dict(buffers=False)
    plain_final = plain.full_state_dict(buffers=False)
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    state = [t for s in master.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {
        "case": f"{name}/dp={dp}/pp={pp}/zero{zero}/m={accum}", "losses": losses, "ref_losses": ref_losses,
        "plain_losses": plain_losses,
        "params": gaps({k: v for k, v in final.items() if k in ref_final}, ref_final),
        "unlike_plain": max((final[k] - plain_final[k]).abs().max().item() for k in final),
        "names_unlike_the_models": sorted(set(final) ^ set(ref_final)),
        "offload": master.offload, "masters": len(master.masters),
        # the masters are copies of their own, in host memory; the optimizer's state lives with them
        "masters_apart": all(m is not p and m.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                             for m, p in zip(master.masters, master.params)),
        "master_devices": sorted({m.device.type for m in master.masters}),
        "state_devices": sorted({t.device.type for t in state}), "state_tensors": len(state),
    }


def two_ranks(ctx: DistContext, out: str) -> list[dict]:
    return [compare(ctx, "gpt", dp=2), compare(ctx, "gpt", dp=2, zero=1), compare(ctx, "gpt", dp=2, zero=2),
            compare(ctx, "gpt", pp=2, cuts_at=(1,), accum=4)]


LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {"2ranks": (2, two_ranks)}
