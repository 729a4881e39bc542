"""The pipeline search's result: its candidates and decision, why each candidate lost, and what
to relax when nothing fits (the pipeline search's explanation strings live here alone)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from partita.core.cluster import ClusterSpec
from partita.core.errors import InfeasibleError
from partita.core.optimizers import NO_OFFLOAD
from partita.core.plans.plan import MemoryBreakdown, Stage
from partita.core.recompute import NONE
from partita.passes.cost_model import PipelineStepCost
from partita.passes.dp.zero import STRATEGY_NAMES
from partita.passes.explain import CHOSEN, gb, peak_terms, slower, slower_parts, traffic_reason
from partita.passes.pipeline.bounds import PrunedCandidate
from partita.passes.pipeline.costs import NodeCosts, SharedParam

INF = math.inf


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a candidate: positions [start, stop) of the pipeline order."""

    index: int
    start: int
    stop: int
    first_node: str
    last_node: str
    params: int  # parameters held by one device (shared ones counted in every stage using them)
    forward_s: float  # one micro-batch
    backward_s: float
    p2p_s: float  # its sends per micro-batch
    slot_s: float  # forward + backward + overhead + sends
    memory: MemoryBreakdown  # per device
    in_flight: int  # micro-batches of activations held at the peak
    send_bytes: int  # activations sent to the next stage per micro-batch
    ranks: tuple[int, ...]
    modules: tuple[str, ...]
    recompute: str = NONE  # what reruns in backward (core/recompute.py): none, attention cores, whole layers

    def to_plan(self, micro_batches: int) -> Stage:
        return Stage(
            index=self.index, nodes=self.stop - self.start, first_node=self.first_node, last_node=self.last_node,
            params=self.params, predicted_time_s=micro_batches * self.slot_s, memory_bytes=self.memory.total,
            forward_s=self.forward_s, backward_s=self.backward_s, ranks=self.ranks, modules=self.modules,
            send_bytes=self.send_bytes, recompute=self.recompute,
        )


@dataclass(frozen=True)
class PipelineCandidate:
    pp: int
    dp: int
    tp: int
    micro_batch_size: int
    micro_batches: int  # per data-parallel rank per step
    schedule: str  # "none" (p = 1), or one of core/schedule.py SCHEDULES
    shared_policy: str  # "" (no shared parameter), "kept together" or "split"
    cuts: tuple[str, ...]  # the last node of every stage but the last
    stages: tuple[PipelineStage, ...]
    cost: PipelineStepCost | None  # None when it does not fit
    memory: MemoryBreakdown  # the most loaded stage (with the least-memory cuts when none fits)
    zero_stage: int = 0
    dp_traffic_bytes: int = 0  # the slowest tail's data-parallel bytes sent per step
    cut_for: int | None = None  # not fitting: None when cut for least memory, else the ZeRO stage whose cuts it shows
    offload: str = NO_OFFLOAD  # the optimizer's state and masters in host memory (core/optimizers.py)
    chunks: int = 1  # virtual stages per rank (interleaved 1F1B): ``stages`` holds pp x chunks
    ep: int = 1  # experts split over groups of ep dp ranks of each stage (passes/experts.py)

    @property
    def fits(self) -> bool:
        return self.cost is not None

    @property
    def step_s(self) -> float:
        return self.cost.step_s if self.cost else INF

    @property
    def key(self) -> tuple[int, int, int, str, str, int, str, int]:
        return (self.pp, self.dp, self.micro_batch_size, self.schedule, self.shared_policy, self.zero_stage,
                self.offload, self.chunks)


@dataclass(frozen=True)
class PipelineDecision:
    best: PipelineCandidate
    candidates: tuple[PipelineCandidate, ...]  # the fitting ones fastest first, then the rest by memory
    reasons: dict[tuple, str]  # candidate.key -> why it lost ("chosen: ..." for best)
    order: tuple[str, ...]  # the pipeline order stages are runs of
    boundaries: tuple[int, ...]  # where cuts were allowed
    shared: tuple[SharedParam, ...]  # parameters a cut could split (tied embeddings)
    solves: int  # dynamic programs run
    seconds: float
    pruned: tuple[PrunedCandidate, ...] = ()  # groups the pruned search did not cut (choose_pipeline)

    @property
    def stages(self) -> tuple[PipelineStage, ...]:
        return self.best.stages

    def plan_stages(self) -> tuple[Stage, ...]:
        return tuple(s.to_plan(self.best.micro_batches) for s in self.best.stages)


# -- why each candidate lost -----------------------------------------------------------


def recomputes(c: Any) -> bool:
    """Whether a plan's candidate (its ``stages``) recomputes activations on any stage."""
    return any(s.recompute != NONE for s in c.stages)


def binds_memory(c: Any) -> bool:
    """Whether a candidate shows memory binding: it recomputes or offloads to fit (the search then
    weighs what holds less: the split residual stream, passes/search.py; a split sequence,
    passes/context.py)."""
    return c.offload != NO_OFFLOAD or recomputes(c)


def _label(c: PipelineCandidate) -> str:
    sched = "" if c.schedule == "none" else f" {c.schedule.upper()}" + (f" x {c.chunks} chunks" if c.chunks > 1 else "")
    zero = f", {STRATEGY_NAMES[c.zero_stage]}" if c.zero_stage else ""
    return f"pp={c.pp} x dp={c.dp}, {c.micro_batches} micro-batch(es) of {c.micro_batch_size}{sched}{zero}"


def _binding(c: PipelineCandidate) -> str:
    """The most loaded stage of ``c``, in words and GB."""
    st = max(c.stages, key=lambda s: s.memory.total)
    m = st.memory
    return (f"stage {st.index} needs {gb(m.total)} (params {gb(m.params)} + grads {gb(m.grads)} + "
            f"optimizer {gb(m.optimizer)} + activations of {st.in_flight} micro-batch(es) "
            f"{gb(m.activations)}{peak_terms(m)}), budget {gb(m.capacity)}")


def loss_reason(c: PipelineCandidate, best: PipelineCandidate, cluster: ClusterSpec) -> str:
    if c is best:
        return CHOSEN
    if not c.fits:
        zero = f"{STRATEGY_NAMES[c.zero_stage]} " if c.zero_stage else ""
        if c.cut_for is not None:
            return (f"{zero}does not fit: no cuts fit; at the cuts that fit {STRATEGY_NAMES[c.cut_for]}, "
                    f"{_binding(c)}")
        return f"{zero}does not fit even with its least-memory cuts: {_binding(c)}"
    a, b = c.cost, best.cost
    assert a is not None and b is not None
    if c.step_s <= best.step_s * (1 + 1e-9):
        return (f"same step time, more memory: {gb(c.memory.total)} vs {gb(best.memory.total)}"
                + (" (GPipe holds all m micro-batches, 1F1B at most p)" if c.schedule == "gpipe" else ""))
    parts = slower_parts((("compute", a.compute_s, b.compute_s), ("bubble", a.bubble_s, b.bubble_s),
                          ("p2p", a.p2p_s, b.p2p_s),
                          ("data-parallel collectives" if c.zero_stage or best.zero_stage else "gradient all-reduce",
                           a.dp_all_reduce_s, b.dp_all_reduce_s),
                          ("tied all-reduce", a.tied_all_reduce_s, b.tied_all_reduce_s),
                          ("optimizer", a.optimizer_s, b.optimizer_s)))
    if c.zero_stage and a.dp_all_reduce_s > b.dp_all_reduce_s * 1.001:
        parts.append(traffic_reason(c.zero_stage, c.dp_traffic_bytes, cluster.link_for_group(c.dp, stride=c.tp),
                                    a.dp_all_reduce_s))
    return slower(c.step_s / best.step_s, parts)


def infeasible_error(candidates: list[PipelineCandidate], cluster: ClusterSpec) -> InfeasibleError:
    least = min(candidates, key=lambda c: (c.memory.total, -c.pp))
    return InfeasibleError(
        f"no pipeline plan fits: the least memory, {_label(least)}, with the cuts that minimise the largest "
        f"stage: {_binding(least)} ({cluster.memory_bytes / 1e9:.0f} GB less {cluster.memory_reserve:.0%} reserve)",
        hint="add devices (more stages), use smaller micro-batches, tensor parallelism within a stage, "
        "or ZeRO to shard the optimizer state",
    )


def stage_modules(costs: NodeCosts, j: int, k: int) -> tuple[str, ...]:
    """Layers as ``prefix.a-b`` runs, then the other modules owning parameters, in order."""
    out: list[str] = []
    run: list[str] = []  # [prefix, first index, last index] of the current run of layers
    for label in costs.module_runs(j, k):
        prefix, _, index = label.rpartition(".")
        if label and index.isdigit() and label in costs.layers:
            if run and run[0] == prefix and int(index) in (int(run[2]), int(run[2]) + 1):
                run[2] = index
                continue
            if run:
                out.append(_run_name(run))
            run = [prefix, index, index]
        elif label and label not in out:
            if run:
                out.append(_run_name(run))
                run = []
            out.append(label)
    if run:
        out.append(_run_name(run))
    return tuple(out)


def _run_name(run: list[str]) -> str:
    prefix, a, b = run
    return f"{prefix}.{a}" if a == b else f"{prefix}.{a}-{b}"
