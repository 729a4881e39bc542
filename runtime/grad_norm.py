"""The global gradient norm of a step, however the plan spread the gradients, and clipping by it.

Each rank sums the squares of the gradients its optimizer updates, weighting every element by
one over the number of ranks holding an identical copy of it, then one all-reduce over the world
adds the sums up; so every element of the model counts once, as in one process's
``torch.nn.utils.clip_grad_norm_``:

- a ZeRO shard's gradient is this rank's alone (weight 1); a whole parameter under plain data
  parallelism is the same averaged gradient on each of the dp ranks (1/dp);
- a parameter replicated over "tp" has the same gradient on each tp rank (1/tp), a shard is
  this rank's part (1);
- a parameter tied across pipeline stages has the summed gradient on each stage holding it
  (1/stages);
- an expert's slice under expert parallelism is on the dp ranks holding the same experts alone
  (ep/dp).

Squares are summed in fp32 whatever the gradients' dtype; under fp16 loss scaling the norm is
of the unscaled gradients. Clipping multiplies the update by ``max_norm / (norm + 1e-6)`` when
that is below 1, folded into the masters' step (runtime/mixed_precision.py), so no gradient is
rewritten.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from partita.core.placement import is_shard
from partita.runtime.program import Program


def copy_weights(program: Program, tp_size: int) -> dict[int, float]:
    """id(tensor) -> 1 / (ranks holding an identical copy of its gradient), for every tensor
    whose gradient the step's optimizer reads (module docstring)."""
    weights: dict[int, float] = {}
    updates = program.updates
    if updates is None:
        return weights
    tp = program.tp_module
    placement = {id(q): pl for q, pl in tp.local_parameters().values()} if tp is not None else {}
    tied = {id(t.param): len(t.ranks) for t in program.pipeline.ties} if program.pipeline is not None else {}
    experts = ({id(q) for n, (q, _) in tp.local_parameters().items() if n in tp.expert_params}
               if tp is not None else set())
    shards = {id(s) for s in program.zero.shards} if program.zero is not None else set()
    for q in updates.params:
        if id(q) in shards:
            continue  # ZeRO's flat shards: weighted member by member (``NormTerms.slices``)
        w = 1.0 / program.dp_size
        if id(q) in experts:
            w *= program.plan.mesh.ep
        if tp_size > 1 and not is_shard(placement.get(id(q), "replicate")):
            w /= tp_size
        w /= tied.get(id(q), 1)
        weights[id(q)] = w
    return weights


class NormTerms:
    """What a rank's gradient norm reads, worked out once from the program's structure: each
    gradient's copy weight (``copy_weights``), and ZeRO's flat shards as (shard, slice, weight) per
    member parameter (a member replicated over "tp" has the same slice on every tp rank)."""

    def __init__(self, program: Program, tp_size: int) -> None:
        self.weights = copy_weights(program, tp_size)
        self.params = [q for q in program.updates.params if id(q) in self.weights] if program.updates else []
        self.slices: list[tuple[int, int, int, float]] = []
        if program.zero is not None:
            tp = program.tp_module
            placement = {id(q): pl for q, pl in tp.local_parameters().values()} if tp is not None else {}
            for i, b in enumerate(program.zero.buckets):
                for p, offset in zip(b.members, b.offsets):
                    numel = math.prod(b.shapes[b.index[id(p)]])  # (a ZeRO-3 member is parked empty)
                    lo, hi = max(offset, b.own.start), min(offset + numel, b.own.stop)
                    if lo < hi:
                        w = 1.0 if tp_size == 1 or is_shard(placement.get(id(p), "replicate")) else 1.0 / tp_size
                        self.slices.append((i, lo - b.own.start, hi - b.own.start, w))


class GradNorm(NamedTuple):
    norm: float  # the whole model's gradient norm
    unreached: bool  # a rank had a parameter no backward of the step reached (BucketReducer.unreached)


def global_grad_norm(program: Program, tp_size: int, device: torch.device, inv_scale: float = 1.0,
                     reduced: Mapping[int, torch.Tensor] | None = None, unreached_here: bool = False) -> GradNorm:
    """The L2 norm of the whole model's (unscaled) gradient; a collective over the world, whose
    all-reduce also says whether any rank had a parameter without a gradient (``unreached_here``).
    ``reduced``: a parameter's mean gradient by ``id`` where the reducer kept it (not in ``.grad``).
    The squares are summed by one foreach norm per copy weight, not one kernel per parameter."""
    reduced = reduced or {}
    if program.norm_terms is None:
        program.norm_terms = NormTerms(program, tp_size)
    terms: NormTerms = program.norm_terms
    by_weight: dict[float, list[torch.Tensor]] = {}
    for q in terms.params:
        g = reduced.get(id(q), q.grad)
        if g is not None:
            by_weight.setdefault(terms.weights[id(q)], []).append(g)
    if terms.slices:
        shards = program.zero.shards
        for i, lo, hi, w in terms.slices:
            g = shards[i].grad
            if g is not None:
                by_weight.setdefault(w, []).append(g[lo:hi])
    total = torch.zeros(2, dtype=torch.float32, device=device)  # (sum of squares, ranks with unreached)
    for w, grads in by_weight.items():
        total[0] += _square_sum(grads) * w
    total[1] = float(unreached_here)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    squares, unreached = total.tolist()
    return GradNorm(math.sqrt(squares) * inv_scale, unreached > 0)


def _square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of ``grads``, accumulated in fp32 without an fp32 copy of a bf16 or fp16
    gradient: one ``_foreach_norm`` (``dtype=float32``) over them all."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """What the update is multiplied by to clip ``norm`` to ``max_norm`` (1 when it is within)."""
    if max_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
