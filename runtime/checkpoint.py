"""The whole model's parameters back from however the plan spread them.

``full_state_dict(model)`` returns every parameter of the model at its full
shape, on every rank, whatever the plan: tensor-parallel shards are
all-gathered over "tp", pipeline stages broadcast what they hold, ZeRO
shards are gathered. It is a collective: every rank must call it. Use it to
save a checkpoint a single process can load, or to compare with a
single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.core.placement import shard_dim
from partita.core.plan import Plan
from partita.core.precision import PrecisionPolicy
from partita.runtime.program import Program

def full_state_dict(program: Program) -> dict[str, torch.Tensor]:
    """Every parameter of the model at full shape, on every rank (a collective)."""
    if program.zero is not None:
        with program.zero.gathered():  # ZeRO's shards back to this rank's (TP-local) parameters
            return _gathered(program)
    return _gathered(program)


def _gathered(program: Program) -> dict[str, torch.Tensor]:
    plan = program.plan
    tp = program.interpreter
    if tp is None:  # the eager module holds whole parameters
        return {k: v.detach().clone() for k, v in program.module.named_parameters()}
    local = tp.local_parameters()
    full: dict[str, torch.Tensor] = {}
    group = tp.tp.group if plan.mesh.tp > 1 else None
    for decision in plan.params:
        if decision.name not in local:
            continue
        shard, placement = local[decision.name]
        full[decision.name] = _gather(shard.detach(), placement, group, plan.mesh.tp)
    if plan.mesh.pp > 1:
        full = _from_every_stage(full, plan, program.ctx.device)
    return full


def _gather(shard: torch.Tensor, placement: str, group: dist.ProcessGroup | None, t: int) -> torch.Tensor:
    dim = shard_dim(placement)
    if group is None or dim is None:
        return shard.clone()
    parts = [torch.empty_like(shard) for _ in range(t)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _from_every_stage(mine: dict[str, torch.Tensor], plan: Plan, device: torch.device) -> dict[str, torch.Tensor]:
    """Each parameter broadcast from the first rank of the stage that holds it, in plan order."""
    out: dict[str, torch.Tensor] = {}
    for decision in plan.params:
        src = plan.mesh.stage_ranks(decision.stage)[0]
        dtype = PrecisionPolicy.of(plan.training).held_dtype(getattr(torch, decision.dtype))
        t = mine.get(decision.name)
        buf = t.to(device) if t is not None and dist.get_rank() == src else torch.empty(
            decision.shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src)
        out[decision.name] = buf.cpu()
    return out
