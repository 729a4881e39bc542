"""Branch and bound for the pipeline search: a lower bound on a (p, dp, micro-batch, m) group's
step, and the record of groups it pruned (``choose_pipeline(prune=True)``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from partita.core.cluster import ClusterSpec
from partita.core.errors import PartitaError
from partita.core.optimizers import NO_OFFLOAD
from partita.core.pins import TrainingRequest
from partita.passes.cost_model import StateBytes, zero_step_comm
from partita.passes.dp.zero import STRATEGY_NAMES
from partita.passes.pipeline.costs import NodeCosts, Recompute
from partita.passes.pipeline.cuts import Partition, StageSetup, stage_optimizer_time
from partita.passes.pipeline.ranges import first_turned

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
    ep: int = 1  # the experts split over ep of the dp ranks (passes/experts.py)
    binds: bool = False  # cut under a cap where every fit recomputes or offloads: memory binds there


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
    latency plus the bandwidth of all its bytes, and its optimizer pass (the device's,
    or the host's where offload is weighed, whichever is less), both non-decreasing
    in the parameters held (cost_model.zero_step_comm, cuts.stage_optimizer_time). The
    tied all-reduce is >= 0. Over the ZeRO stages weighed the least of these bounds is
    taken: which one fits is not known before cutting.
    """

    _SLACK = 1 - 1e-6  # float sums in another order, and the linear read-off of ``compute``

    def __init__(self, cluster: ClusterSpec, request: TrainingRequest, state: StateBytes, tp: int,
                 floor_costs: Callable[[int], NodeCosts], chunks: int = 1, host: float | None = None):
        self.cluster, self.request, self.state, self.tp = cluster, request, state, tp
        self.host = host  # bytes per parameter on the host where offload is weighed: its step may be the faster
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
        opt = stage_optimizer_time(numel, self.state, z, dp, self.cluster)
        if self.host is not None:
            opt = min(opt, stage_optimizer_time(numel, self.state, z, dp, self.cluster, self.host))
        return slots, comm * self._SLACK, opt * self._SLACK

    def slot_cap(self, setup: StageSetup, mb: int, best_s: float) -> float:
        """A bound on the cut DP's objective (the slowest stage's slot) under ``setup``: cuts whose
        slowest slot reaches it give a step above ``best_s``. From ``pipeline_step``: step >=
        (m + (p - 1) / v) x the slowest rank's slot + the tail, a rank's slot (its v chunks' summed)
        is at least its slowest chunk's, and the tail is at least this bound's (``parts``: its
        collectives, and its optimizer pass, the device's or the host's). A hair above, so that a
        step equal to the best (a tie its memory may break) is still cut."""
        if best_s == INF:
            return INF
        p, v, m = setup.stages // setup.chunks, setup.chunks, setup.micro_batches
        _, comm, opt = self.parts(p, setup.dp, mb, m, setup.zero_stage)
        tail = comm + opt
        return (best_s - tail) / (m + (p - 1) / v) * (1 + 1e-9)

    def capped(self, setup: StageSetup, dp: int, tp: int, mb: int, cap: float, best_s: float) -> PrunedCandidate:
        """The record of cuts left unfinished under ``slot_cap``: they fit, but cannot win."""
        p = setup.stages // setup.chunks
        offloaded = ", optimizer offloaded" if setup.offload != NO_OFFLOAD else ""
        return PrunedCandidate(p, dp, tp, mb, setup.micro_batches, setup.zero_stage, best_s, False,
                               f"not solved to the end: every cut fitting memory has a stage slot above "
                               f"{cap:.4g} s, a step above the best {best_s:.4g} s ({setup.schedule}, "
                               f"{STRATEGY_NAMES[setup.zero_stage]}{offloaded})", setup.schedule)

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


def cut_windows(part: Partition, cap: float) -> list[tuple[int, int]] | None:
    """Where stage s of any cuts whose every stage fits memory with a slot below ``cap`` ends:
    ``(lo, hi)`` per stage, the last ``(n, n)``; None where no such cuts exist. A branch-and-bound
    test that saves ``solve_cuts(part, cap=cap)``, and the rows that call weighs.

    Two greedy passes over a relaxation of ``time_cost``: a segment's sends left out of its memory and
    its slot, so that a segment inside another of the same stage fits whenever that one does; its
    recomputation is decided by ``Partition._decide`` (so no later mode than with the sends, and no
    more time). Forward: stage s from ``hi`` of stage s - 1 takes the furthest boundary that fits
    (or none): if some cuts ended stage s later, their stage s would hold that segment. Backward: stage
    s + 1 ending at ``lo`` of stage s + 1 starts at the earliest boundary that fits (or none), by the
    same argument from the end. Cuts end each stage within its window, and the first and the last
    stage fit from 0 and to the end."""
    p, n, ends = part.setup.stages, part.n, part.boundaries
    overhead, cap_bytes = part.cluster.step_overhead_s, part.setup.capacity

    def fits(j: int, k: int, s: int) -> bool:
        total, mode = part._decide(j, k, s, sends=False)
        return total <= cap_bytes and part._compute(j, k, mode) + overhead < cap

    # a segment inside another fits whenever that one does: the ends that fit are a run, found by bisection
    hi, j, i = [], 0, 0  # i: the first boundary after j
    for s in range(p - 1):
        i = first_turned(i, len(ends), lambda x, j=j, s=s: not fits(j, ends[x], s))
        j = ends[i - 1] if i and ends[i - 1] > j else j
        hi.append(j)
    if not fits(j, n, p - 1):
        return None
    lo, k, i = [n], n, len(ends) - 1  # i: the last boundary before k
    for s in range(p - 1, 0, -1):
        i = first_turned(0, i + 1, lambda x, k=k, s=s: fits(ends[x], k, s)) - 1  # the last start before k not fitting
        k = ends[i + 1] if i + 1 < len(ends) and ends[i + 1] < k else k
        lo.append(k)
    if not fits(0, k, 0):
        return None
    lo.reverse()
    windows = list(zip(lo[:-1], hi)) + [(n, n)]
    return None if any(a > b for a, b in windows) else windows
