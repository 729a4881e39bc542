"""The whole model's parameters (and buffers) back from however the plan spread them.

``full_state_dict(model)`` returns every parameter of the model at its full
shape, on every rank, whatever the plan: tensor-parallel shards are
all-gathered over "tp", experts over their expert group ("ep"), pipeline stages broadcast what they hold, ZeRO
shards are gathered; and, unless ``buffers=False``, every persistent buffer
(batch norm's running statistics: the same on every replica, averaged over
"dp" each step), so that ``model.load_state_dict`` of one process takes it
strictly. It is a collective: every rank must call it. Use it to save a
checkpoint a single process can load, or to compare with a single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.core.placement import shard_dim
from partita.core.plans.plan import Plan
from partita.core.precision import PrecisionPolicy
from partita.runtime.distributed import shared_from
from partita.runtime.program import Program


def full_state_dict(program: Program, *, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of the model at full shape, and its persistent buffers, on every rank (a
    collective)."""
    if program.zero is not None:
        with program.zero.gathered():  # ZeRO's shards back to this rank's (TP-local) parameters
            state = _gathered(program)
    else:
        state = _gathered(program)
    state = _with_aliases(state, program.state_names)
    return {**state, **_buffers(program)} if buffers else state


def _with_aliases(state: dict[str, torch.Tensor], names: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``state`` with every name a tied parameter has in the model's ``state_dict()`` (GPT-2's
    ``lm_head.weight`` beside ``transformer.wte.weight``), each the same tensor, so that the plain
    model loads it strictly, as its own ``state_dict()`` would."""
    out = dict(state)
    for aliases in names.values():
        have = next((n for n in aliases if n in state), None)
        if have is not None:
            for n in aliases:
                out.setdefault(n, state[have])
    return out


def _buffers(program: Program) -> dict[str, torch.Tensor]:
    """The persistent buffers, whole (never split over "tp"), each from a rank of the stage that holds it."""
    tp = program.tp_module
    if tp is None:
        mine = {k: v for k, v in program.module.named_buffers()}
    else:
        mine = {tp.buffer_nodes[n]: v for n, v in tp.buffers_by_node().items()}
    mine = {k: v.detach().cpu().clone() for k, v in mine.items() if k in program.persistent}
    if program.plan.mesh.pp == 1:
        return mine
    out: dict[str, torch.Tensor] = {}
    for stage in range(program.plan.mesh.pp):  # small tensors: sent as objects, their shapes unknown elsewhere
        src = program.plan.mesh.stage_ranks(stage)[0]
        out.update(shared_from(mine if dist.get_rank() == src else None, src))
    return out


def _gathered(program: Program) -> dict[str, torch.Tensor]:
    plan = program.plan
    tp = program.tp_module
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
        if tp.experts is not None and decision.name in tp.expert_params:  # this rank's experts: dim 0
            full[decision.name] = _gather(full[decision.name], "shard(0)", tp.experts.g.group, tp.experts.g.size)
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
    """Each parameter broadcast from the first rank of the stage that holds it, in plan order, in
    the dtype that stage holds it in (the policy's, or its own for batch norm's: runtime/mixed_precision.py
    ``kept_whole``; each stage says which first, in one small broadcast)."""
    out: dict[str, torch.Tensor] = {}
    held: dict[str, torch.dtype] = {}
    for stage in range(plan.mesh.pp):
        src = plan.mesh.stage_ranks(stage)[0]
        held.update(shared_from({k: v.dtype for k, v in mine.items()} if dist.get_rank() == src else None, src))
    policy = PrecisionPolicy.of(plan.training)
    for decision in plan.params:
        src = plan.mesh.stage_ranks(decision.stage % plan.mesh.pp)[0]  # virtual stage c: on pp rank c mod pp
        dtype = held.get(decision.name) or policy.held_dtype(getattr(torch, decision.dtype))
        t = mine.get(decision.name)
        buf = t.to(device) if t is not None and dist.get_rank() == src else torch.empty(
            decision.shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src)
        out[decision.name] = buf.cpu()
    return out
