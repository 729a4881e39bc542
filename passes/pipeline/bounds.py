"""Branch and bound for the pipeline search: a lower bound on a (p, dp, micro-batch, m) group's
step, and the record of groups it pruned (``choose_pipeline(prune=True)``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partita.core.cluster import ClusterSpec
from partita.core.errors import PartitaError
from partita.core.pins import TrainingRequest
from partita.passes.cost_model import StateBytes, zero_optimizer_time, zero_step_comm
from partita.passes.dp.zero import STRATEGY_NAMES
from partita.passes.pipeline.costs import NodeCosts, Recompute
from partita.passes.pipeline.cuts import Partition, StageSetup

INF = math.inf


# -- branch and bound ----------------------------------------------------------------


@dataclass(frozen=True)
class PrunedCandidate:
    """A (p, micro-batch) group the pruned search did not cut, and why that loses nothing."""

    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    micro_batches: int
    zero_stage: int  # the smallest ZeRO stage weighed (time bound) or the largest (memory)
    lower_bound_s: float  # inf when it was pruned for memory
    memory: bool  # pruned because no cuts fit, not because it was slower
    reason: str
    schedule: str = ""  # the one schedule no cuts fit ("": the whole group)
    cp: int = 1  # each sequence split over cp of the dp ranks (passes/context.py)


class AllPruned(PartitaError):
    """Every (p, micro-batch) group of a ``choose_pipeline(prune=True)`` call was pruned or fits
    nowhere, while a plan found elsewhere (its ``bound``) fits: nothing here can win."""

    def __init__(self, pruned: tuple[PrunedCandidate, ...]):
        super().__init__(f"{len(pruned)} pipeline groups pruned: none can beat the bound")
        self.pruned = pruned


class PipelineBound:
    """A lower bound on the step of every candidate of a (p, dp, micro-batch, m) group.

    From ``pipeline_step``: step = (m + (p - 1) / v) max_s slot_s + max_s tail_s + tied, v the
    most chunks per rank of the schedules weighed (1 but for interleaved 1F1B).
    The slowest slot is at least the mean, sum(forward + backward) / p + overhead
    (sends >= 0), and the sum is at least the floor costs' (per-node compute at 1/tp
    of the FLOPs, no TP collectives: every strategy's compute fraction is 1/tp or
    1). The slowest tail is at least that of a stage holding 1/p of the local
    parameters (at least 1/tp of each): its data-parallel collectives, one bucket's
    latency plus the bandwidth of all its bytes, and its optimizer pass, both
    non-decreasing in the parameters held (cost_model.zero_step_comm,
    zero_optimizer_time). The tied all-reduce is >= 0. Over the ZeRO stages weighed
    the least of these bounds is taken: which one fits is not known before cutting.
    """

    _SLACK = 1 - 1e-6  # float sums in another order, and the linear read-off of ``compute``

    def __init__(self, cluster: ClusterSpec, request: TrainingRequest, state: StateBytes, tp: int,
                 floor_costs: Callable[[int], NodeCosts], chunks: int = 1):
        self.cluster, self.request, self.state, self.tp = cluster, request, state, tp
        self.chunks = chunks  # the most chunks per rank a schedule weighed runs: its bubble is the least
        self._build = floor_costs
        self._floors: dict[int, NodeCosts] = {}
        self._recomputed: dict[tuple, Recompute | None] = {}
        self.grad_elem = 0 if request.inference else max(1, int(state.grads))

    def floor(self, mb: int) -> NodeCosts:
        return cached_costs(self._floors, self._build, mb)

    def partition(self, mb: int, setup: StageSetup, forbid: Sequence[int],
                  recompute: Callable[[NodeCosts], Recompute | None] = lambda c: None) -> Partition:
        """The floor costs cut under ``setup``, with a byte of slack per 1e6 for rounding (and the
        floor of recomputation's memory where it is weighed: a layer's inputs and its largest
        layer's activations never exceed the real ones either)."""
        floor = self.floor(mb)
        key = (mb, recompute)
        if key not in self._recomputed:  # the same floor is cut under many setups
            self._recomputed[key] = recompute(floor)
        return Partition(floor, replace(setup, capacity=round(setup.capacity * (1 + 1e-6))), self.cluster,
                         forbid=forbid, recompute=self._recomputed[key])

    def compute(self, mb: int) -> float:
        """The floor costs' forward + backward of one micro-batch of ``mb``, summed. Each node's
        is a + b mb (node_costs scales batch-dependent nodes linearly), so the sum is read off
        the floors at micro-batches 1 and 2 rather than built at every size: only the groups
        the bound does not prune need their floors position by position."""
        one, two = self.floor(1).prefix_sums[0][-1], self.floor(2).prefix_sums[0][-1]
        return one + (two - one) * (mb - 1)

    def parts(self, p: int, dp: int, mb: int, m: int, z: int) -> tuple[float, float, float]:
        """(compute + bubble, data-parallel collectives, optimizer) lower bounds, seconds."""
        f = self.floor(1)  # parameters do not depend on the micro-batch
        compute = self.compute(mb) * self._SLACK
        numel = (f.prefix_sums[3][-1] + sum(sp.numel for sp in f.shared)) / p
        slots = (m + (p - 1) / self.chunks) * (compute / p + self.cluster.step_overhead_s)
        if self.request.inference or numel <= 0:
            return slots, 0.0, 0.0
        comm = 0.0
        if dp > 1:
            link = self.cluster.link_for_group(dp, stride=self.tp)
            comm = zero_step_comm(z, [numel * self.grad_elem], dp, m, link, elem_bytes=self.grad_elem,
                                  reduce_dtype=self.request.reduce_dtype).total_s
        return slots, comm * self._SLACK, zero_optimizer_time(numel, self.state, z, dp, self.cluster) * self._SLACK

    def step(self, p: int, dp: int, mb: int, m: int, zs: Sequence[int]) -> float:
        return min((sum(self.parts(p, dp, mb, m, z)) for z in zs), default=INF)

    def explain(self, p: int, dp: int, mb: int, m: int, zs: Sequence[int]) -> str:
        z = min(zs, key=lambda z: sum(self.parts(p, dp, mb, m, z)))
        slots, comm, opt = self.parts(p, dp, mb, m, z)
        return (f"pp={p} dp={dp} tp={self.tp}, {m} x {mb}: compute + bubble >= {slots:.4g} s, "
                f"data-parallel collectives >= {comm:.3g} s, optimizer >= {opt:.3g} s at {STRATEGY_NAMES[z]}")


def cached_costs(cache: dict[int, NodeCosts], build: Callable[[int], NodeCosts], mb: int) -> NodeCosts:
    if mb not in cache:
        cache[mb] = build(mb)
    return cache[mb]
