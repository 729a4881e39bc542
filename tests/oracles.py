"""Reference implementations the tests check the product against: oracles, not product code.

Each is simpler (or slower) than what partita ships and independent of it where it
matters, so a test comparing the two can fail:

- ``exhaustive_choice``: the TP layout by enumeration, the optimum the ILP
  (passes/tp/ilp.py) must match;
- ``choose_data_parallel``: the pure data-parallel planner by enumeration over
  (dp, micro-batch), priced by ``data_parallel_step``, which the joint search must
  rediscover when the model fits;
- ``max_params_fitting``, ``strategies_at``: small rules the tests state known
  answers with.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from partita.core.buckets import DEFAULT_BUCKET_BYTES
from partita.core.cluster import ClusterSpec
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.pins import Pins, TrainingRequest
from partita.core.plans.plan import MemoryBreakdown
from partita.core.precision import activation_scale, torch_dtype
from partita.core.tp.strategies import node_strategies, valid_at
from partita.core.tp.vocabulary import Strategy
from partita.passes.cost_model import (
    ModelStateMemory,
    StateBytes,
    StepCost,
    collective_time,
    collective_traffic,
    compute_time,
    model_state_memory,
    optimizer_time,
    state_bytes_per_param,
)
from partita.passes.dp.buckets import gradient_buckets
from partita.passes.tp.problem import EdgeClass, NodeClass, TPProblem, TPSolution, TPSolveReport, evaluate

# -- the TP layout by enumeration ---------------------------------------------------------


def exhaustive_choice(problem: TPProblem, *, max_states: int = 2_000_000) -> TPSolution:
    """The optimum over the product of all classes' strategies, by enumeration (small graphs only).

    Independent of any solver. The classes are visited in an order where each
    parameter or input comes just before its first reader; the cost of the
    classes not yet visited depends on the visited ones only through the
    *frontier* (visited classes with an edge to an unvisited one). Without a
    memory budget, the enumeration of the rest is therefore shared between
    prefixes with the same frontier picks (memoised on (position, frontier
    picks)): exact, and it visits at most sum_k prod_{c in frontier(k)} |S_c|
    states. With a finite budget the memory used so far matters too, so every
    prefix is enumerated, cut only where its cost so far plus each remaining
    class's cheapest strategy reaches the best found or its memory so far
    plus each remaining class's smallest exceeds the budget (valid bounds:
    costs are non-negative). ``max_states`` guards against a product too big.
    """
    t0 = time.perf_counter()
    order = _visit_order(problem)
    index = {c.key: k for k, c in enumerate(order)}
    back: list[list[tuple[EdgeClass, int, bool]]] = [[] for _ in order]  # edges to earlier classes
    last_use = list(range(len(order)))
    for ec in problem.edges:
        a, b = index[ec.src], index[ec.dst]
        back[max(a, b)].append((ec, min(a, b), a < b))
        last_use[min(a, b)] = max(last_use[min(a, b)], max(a, b))
    frontier = [[c for c in range(k) if last_use[c] >= k] for k in range(len(order) + 1)]
    valid = [[s for s, c in enumerate(cls.costs) if c.valid] for cls in order]
    bpp = problem.bytes_per_param
    budget = problem.setting.memory_budget
    accum = problem.setting.grad_accum
    visited = [0]

    def step(k: int, s: int, pick: dict[int, int]) -> float | None:
        """Cost of class k running s, with its edges to the already-picked classes."""
        w = order[k].costs[s].objective(accum)
        for ec, other, src_first in back[k]:
            c = ec.cost(pick[other], s) if src_first else ec.cost(s, pick[other])
            if c is None:
                return None
            w += c
        return w

    if math.isfinite(budget):
        best_cost, best_pick = _enumerate_with_budget(order, valid, step, bpp, budget, max_states, visited,
                                                           accum)
    else:
        memo: dict[tuple[int, tuple[int, ...]], tuple[float, int]] = {}

        def rest(k: int, pick: dict[int, int]) -> float:
            if k == len(order):
                return 0.0
            key = (k, tuple(pick[c] for c in frontier[k]))
            if key in memo:
                return memo[key][0]
            visited[0] += 1
            if visited[0] > max_states:
                raise ValueError(f"exhaustive search passed max_states={max_states}")
            best = (math.inf, -1)
            for s in valid[k]:
                w = step(k, s, pick)
                if w is None:
                    continue
                pick[k] = s
                total = w + rest(k + 1, pick)
                del pick[k]
                if total < best[0]:
                    best = (total, s)
            memo[key] = best
            return best[0]

        import sys
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * len(order) + 100))
        try:
            best_cost = rest(0, {})
        finally:
            sys.setrecursionlimit(limit)
        best_pick = {}
        for k in range(len(order)):
            best_pick[k] = memo[(k, tuple(best_pick[c] for c in frontier[k]))][1]
    if not math.isfinite(best_cost):
        raise InfeasibleError(f"exhaustive search: no combination of strategies fits {budget / 1e9:.2f} GB")
    chosen = {order[k].key: s for k, s in best_pick.items()}
    report = TPSolveReport("exhaustive", "OPTIMAL", best_cost, best_cost, 0.0, time.perf_counter() - t0, 0.0,
                           visited[0], 0, len(order), problem.num_nodes)
    return evaluate(problem, chosen, report)


def _visit_order(problem: TPProblem) -> list[NodeClass]:
    """Classes in graph order, each class that reads nothing (parameters, inputs) moved to just
    before its first neighbour, so that it joins the frontier only while it is used."""
    readers = {ec.dst for ec in problem.edges}
    neighbours: dict[str, list[str]] = {c.key: [] for c in problem.classes}
    for ec in problem.edges:
        neighbours[ec.src].append(ec.dst)
        neighbours[ec.dst].append(ec.src)
    by_key = {c.key: c for c in problem.classes}
    order: list[NodeClass] = []
    placed: set[str] = set()
    for c in problem.classes:
        if c.key not in readers:
            continue
        for nb in neighbours[c.key]:
            if nb not in placed and nb not in readers:
                placed.add(nb)
                order.append(by_key[nb])
        placed.add(c.key)
        order.append(c)
    order += [c for c in problem.classes if c.key not in placed]
    return order


def _enumerate_with_budget(order, valid, step, bpp, budget, max_states, visited, accum):
    """Depth-first over every prefix, cut by the cost and memory bounds (see ``exhaustive_choice``)."""
    min_time = [min((order[k].costs[s].objective(accum) for s in valid[k]), default=math.inf)
                for k in range(len(order))]
    min_mem = [min((order[k].costs[s].memory(bpp) for s in valid[k]), default=math.inf) for k in range(len(order))]
    rest_time = list(itertools.accumulate(reversed(min_time + [0.0])))[::-1]
    rest_mem = list(itertools.accumulate(reversed(min_mem + [0.0])))[::-1]
    by_cost = [sorted(valid[k], key=lambda s, k=k: order[k].costs[s].objective(accum)) for k in range(len(order))]
    best: list = [math.inf, {}]
    pick: dict[int, int] = {}

    def visit(k: int, cost: float, mem: float) -> None:
        if k == len(order):
            if cost < best[0]:
                best[0], best[1] = cost, dict(pick)
            return
        visited[0] += 1
        if visited[0] > max_states:
            raise ValueError(f"exhaustive search passed max_states={max_states}")
        for s in by_cost[k]:
            w = step(k, s, pick)
            if w is None:
                continue
            c2, m2 = cost + w, mem + order[k].costs[s].memory(bpp)
            if c2 + rest_time[k + 1] >= best[0] or m2 + rest_mem[k + 1] > budget * (1 + 1e-12):
                continue
            pick[k] = s
            visit(k + 1, c2, m2)
            del pick[k]

    visit(0, 0.0, 0.0)
    return best[0], best[1]


# -- the pure data-parallel planner --------------------------------------------------------


def max_params_fitting(memory_bytes: float, state: StateBytes) -> float:
    """The largest parameter count whose model state fits ``memory_bytes`` (no activations)."""
    return memory_bytes / state.total


def data_parallel_step(
    *,
    flops_per_sample: float,
    micro_batch: int,
    grad_accum: int,
    dp: int,
    grad_buckets: list[int],
    state: ModelStateMemory,
    cluster: ClusterSpec,
    precision: str,
) -> StepCost:
    """One data-parallel step: ``grad_accum`` micro-batches of forward+backward, then one
    all-reduce per gradient bucket over the dp group, then the optimizer.

    ``flops_per_sample`` is forward + backward FLOPs of one sample;
    ``grad_buckets`` the bytes of each gradient bucket the runtime all-reduces.
    """
    per_micro = compute_time(flops_per_sample * micro_batch, cluster, precision) + cluster.step_overhead_s
    compute = grad_accum * per_micro
    link = cluster.link_for_group(dp)
    comm = sum(collective_time("all_reduce", b, dp, link) for b in grad_buckets) if dp > 1 else 0.0
    traffic = sum(collective_traffic("all_reduce", b, dp) for b in grad_buckets) if dp > 1 else 0.0
    return StepCost(
        compute_s=compute,
        comm_s={"dp_all_reduce": comm} if dp > 1 else {},
        optimizer_s=optimizer_time(state, cluster),
        traffic_bytes={"dp_all_reduce": round(traffic)} if dp > 1 else {},
    )


class Profile(Protocol):
    num_params: int
    param_dtype: str
    batch_size: int
    flops_fwd: float
    flops_bwd: float

    def activation_bytes(self, micro_batch: int) -> int: ...

    def live_bytes(self, micro_batch: int) -> int: ...


@dataclass(frozen=True)
class Candidate:
    dp: int
    micro_batch_size: int
    grad_accum_steps: int
    memory: MemoryBreakdown
    cost: StepCost

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_s(self) -> float:
        return self.cost.step_s


@dataclass(frozen=True)
class DataParallelDecision:
    best: Candidate
    candidates: tuple[Candidate, ...]  # every candidate, best first among those that fit
    buckets: tuple[int, ...]  # gradient bucket payloads, bytes
    bucket_bytes: int  # the cap the buckets were packed to
    reasons: dict[tuple[int, int], str]  # (dp, micro_batch) -> why it lost ("" for best)
    seconds: float


from partita.passes.space import divisors as _divisors  # noqa: E402


def memory_per_device(profile: Profile, request: TrainingRequest, *, dp: int, micro_batch: int, zero_stage: int,
                      capacity: int) -> MemoryBreakdown:
    """Model state under ZeRO ``zero_stage`` over ``dp`` plus the activations of one micro-batch."""
    state = model_state_memory(
        profile.num_params,
        state_bytes_per_param(request.precision, request.optimizer, inference=request.inference),
        zero_stage=zero_stage,
        dp=dp,
    )
    act = profile.live_bytes(micro_batch) if request.inference else profile.activation_bytes(micro_batch)
    act = round(act * activation_scale(request.precision, profile.param_dtype))
    return MemoryBreakdown(state.params, state.grads, state.optimizer, act, capacity)


def choose_data_parallel(
    profile: Profile,
    param_numels: Sequence[int],
    cluster: ClusterSpec,
    request: TrainingRequest,
    pins: Pins = Pins(),
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> DataParallelDecision:
    """Enumerate (dp, micro-batch) and pick the fastest that fits; see the module docstring."""
    t0 = time.perf_counter()
    devices = pins.world_size or cluster.world_size
    if pins.world_size and pins.world_size > cluster.world_size:
        raise PartitaError(
            f"{pins.world_size} processes were launched but cluster {cluster.name!r} has "
            f"{cluster.world_size} devices ({cluster.nodes} node(s) x {cluster.gpus_per_node})",
            hint="pass a cluster with enough devices (e.g. --nodes)",
        )
    if pins.tp not in (None, 1):
        raise PartitaError(
            f"--tp {pins.tp}: this planner decides data parallelism only; tensor parallelism arrives "
            "with the (dp, tp) mesh search (passes/tp/mesh.choose_mesh)",
            hint="drop --tp (or pass --tp 1)",
        )
    if pins.pp not in (None, 1):
        raise PartitaError(
            f"--pp {pins.pp}: this planner decides data parallelism only; pipelines are chosen by "
            "passes/pipeline/stages.choose_pipeline",
            hint="drop --pp (or pass --pp 1)",
        )
    B = request.global_batch
    if pins.dp is not None:
        if pins.dp > devices:
            raise PartitaError(f"--dp {pins.dp} needs {pins.dp} devices but the cluster has {devices}")
        dps = [pins.dp]
    elif pins.world_size is not None:
        dps = [pins.world_size]  # every launched process is a replica
    else:
        dps = list(range(1, devices + 1))
    bad = [d for d in dps if B % d]
    if len(bad) == len(dps):
        d = dps[0]
        raise PartitaError(
            f"global batch {B} does not divide over dp={d} data-parallel ranks",
            hint=f"use a batch that is a multiple of {d} (e.g. {B + (d - B % d)})",
        )
    dps = [d for d in dps if B % d == 0]

    numels = list(param_numels)
    grad_elem = (max(1, int(state_bytes_per_param(request.precision, request.optimizer).grads))
                 if not request.inference else 0)
    # each bucket all-reduced in the reduce dtype (the runtime casts it for the collective)
    wire = torch_dtype(request.reduce_dtype).itemsize
    buckets = [b * wire // grad_elem for b in gradient_buckets(numels, grad_elem, bucket_bytes)] if grad_elem else []
    flops_per_sample = (profile.flops_fwd + (0 if request.inference else profile.flops_bwd)) / profile.batch_size

    full_state = model_state_memory(
        profile.num_params, state_bytes_per_param(request.precision, request.optimizer, inference=request.inference)
    )
    candidates: list[Candidate] = []
    for dp in dps:
        share = B // dp
        mbs = [pins.micro_batch_size] if pins.micro_batch_size else _divisors(share)
        if pins.grad_accum_steps:
            mbs = [m for m in mbs if m * pins.grad_accum_steps == share]
        for mb in mbs:
            if share % mb:
                continue
            accum = share // mb
            mem = memory_per_device(profile, request, dp=dp, micro_batch=mb, zero_stage=0,
                                    capacity=cluster.usable_memory)
            cost = data_parallel_step(
                flops_per_sample=flops_per_sample, micro_batch=mb, grad_accum=accum, dp=dp,
                grad_buckets=buckets, state=full_state, cluster=cluster, precision=request.precision,
            )
            if request.inference:
                cost = StepCost(cost.compute_s, {}, 0.0, {})
            candidates.append(Candidate(dp, mb, accum, mem, cost))
    if not candidates:
        share = B // dps[0]
        raise PartitaError(
            f"no micro-batch split matches the pins: dp={dps[0]} gives {share} samples per rank, "
            f"micro_batch_size={pins.micro_batch_size}, grad_accum_steps={pins.grad_accum_steps}",
            hint="micro_batch_size x grad_accum_steps must equal global batch / dp",
        )
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise _infeasible(profile, cluster, request, candidates)
    fitting.sort(key=lambda c: (c.step_s, -c.micro_batch_size, -c.dp))
    best = fitting[0]
    reasons = {(c.dp, c.micro_batch_size): _reason(c, best) for c in candidates}
    ordered = fitting + sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.total)
    return DataParallelDecision(best, tuple(ordered), tuple(buckets), bucket_bytes, reasons, time.perf_counter() - t0)


def _reason(c: Candidate, best: Candidate) -> str:
    if c is best:
        return "chosen: fastest predicted step that fits"
    if not c.fits:
        m = c.memory
        return (f"does not fit: {m.total / 1e9:.2f} GB > {m.capacity / 1e9:.2f} GB usable "
                f"(activations {m.activations / 1e9:.2f} GB at micro-batch {c.micro_batch_size})")
    slower = c.step_s / best.step_s
    parts = []
    if c.cost.compute_s > best.cost.compute_s * 1.001:
        parts.append(f"compute {c.cost.compute_s * 1e3:.3g} ms vs {best.cost.compute_s * 1e3:.3g} ms")
    comm, best_comm = sum(c.cost.comm_s.values()), sum(best.cost.comm_s.values())
    if comm > best_comm * 1.001 + 1e-12:
        parts.append(f"gradient all-reduce {comm * 1e3:.3g} ms vs {best_comm * 1e3:.3g} ms")
    if not parts:
        parts.append("equal time; smaller micro-batch or fewer replicas break the tie")
    return f"{slower:.2f}x slower: " + "; ".join(parts)


def _infeasible(profile: Profile, cluster: ClusterSpec, request: TrainingRequest,
                candidates: list[Candidate]) -> InfeasibleError:
    least = min(candidates, key=lambda c: (c.memory.total, -c.dp))
    m = least.memory
    gb = 1e9
    zero = []
    for stage in (1, 2, 3):
        z = memory_per_device(profile, request, dp=least.dp, micro_batch=least.micro_batch_size, zero_stage=stage,
                              capacity=cluster.usable_memory)
        zero.append(f"ZeRO-{stage} {z.total / gb:.1f} GB" + (" (fits)" if z.fits else ""))
    return InfeasibleError(
        f"no data-parallel plan fits: the smallest, dp={least.dp} with micro-batch {least.micro_batch_size}, needs "
        f"{m.total / gb:.1f} GB per device (params {m.params / gb:.1f} + grads {m.grads / gb:.1f} + optimizer "
        f"{m.optimizer / gb:.1f} + activations {m.activations / gb:.1f}); budget {m.capacity / gb:.1f} GB "
        f"({cluster.memory_bytes / gb:.0f} GB less {cluster.memory_reserve:.0%} reserve)",
        hint=f"sharding model state would need {', '.join(zero)} over dp={least.dp} (see `partita estimate`), "
        "or tensor / pipeline parallelism (`partita compile` weighs them all); or use devices with more memory, "
        "or a smaller batch per micro-step",
    )


def strategies_at(G: Any, node: str, t: int, micro_batch: int) -> list[Strategy]:
    """``node_strategies`` valid at ``micro_batch`` (``valid_at``); the first is replicated."""
    return [s for s in node_strategies(G, node, t) if valid_at(G, node, s, t, micro_batch)]
