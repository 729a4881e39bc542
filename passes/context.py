"""Context parallelism's planner half: what splitting every sequence over ``cp`` data-parallel ranks costs.

Reads the attention cores passes/profile.py leaves on the graph (``attention_core``: the rule
recomputation uses, core/recompute.py) and the profile's captured batch. Gives:

- ``context_profile``: the profile as one cp rank sees it. A rank holds ``S / cp`` tokens of each
  of its samples (core/mesh.py ``sequence_chunks``): every op that grows with the input does
  ``1 / cp`` of its work and holds ``1 / cp`` of its tensors, linear ops by the tokens and attention
  by the causal load balance (each rank's two mirrored chunks meet as many keys as any other's:
  ``1 / cp`` of the sequence's attention, Megatron-LM). So a cp rank at micro-batch ``b`` is priced
  as ``b / cp`` captured samples, by every cost the search already has (kernel counts and launch
  costs do not shrink: small GEMMs run below the peak, as the per-shape efficiency says);
- ``core_tensors``: per attention core, the bytes of its query, its keys and values (before any
  expansion to the query's heads: grouped-query attention sends its ``kv_heads``) and its output;
- ``ring_time`` / ``all_to_all_time``: one core's exchange time on the cp group's link, by
  cost_model.collective_time (``send_recv``, ``all_to_all``);
- ``context_node_costs`` / ``context_costs``: the pipeline search's per-node costs with each core's
  exposed exchange added to its first position (forward and backward), the strategy (ring or
  all-to-all) chosen by price per plan unless pinned; ``context_calls`` the calls the plan lists
  (compiler/plan_collectives.py); ``context_parts`` tells them apart from compute in a step.

Writes nothing on the graph. The formulas and their sources: docs/cost-model.md, "Context
parallelism".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import networkx as nx

from partita.core.axes import check_pins
from partita.core.axes.context import ALL_TO_ALL, CP_ATTENTION, RING, RING_GRAD_DTYPE
from partita.core.cluster import ClusterSpec, Link
from partita.core.errors import PartitaError
from partita.core.model.ops import ATTENTION, MATMUL, base_op
from partita.core.optimizers import NO_OFFLOAD
from partita.core.pins import Pins, TrainingRequest
from partita.core.precision import dtype_bytes, element_bytes
from partita.core.recompute import NONE
from partita.passes.cost_model import collective_time, collective_traffic
from partita.passes.pipeline.costs import NodeCosts, output_bytes
from partita.passes.pipeline.decision import binds_memory, recomputes
from partita.passes.profile import ModelProfile
from partita.passes.space import tp_degrees

CP_RING = "cp_ring"  # the comm key of the ring's exchanges not hidden under attention
CP_ALL_TO_ALL = "cp_all_to_all"  # the comm key of the all-to-alls around attention
CP_KEYS = {RING: CP_RING, ALL_TO_ALL: CP_ALL_TO_ALL}
# ops that move no data a ring would not send as is: K and V are traced back through them to the
# tensor before grouped-query attention expands them to the query's heads
_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "expand", "unsqueeze", "transpose", "permute", "clone",
                    "contiguous", "alias"})


def context_profile(profile: ModelProfile, cp: int) -> ModelProfile:
    """``profile`` as one of ``cp`` ranks sharing each sequence sees it (module docstring): captured at
    ``cp`` times its batch, so every batch-dependent cost at a micro-batch is ``1 / cp`` of its own."""
    return profile if cp <= 1 else dataclasses.replace(profile, batch_size=profile.batch_size * cp)


def cp_link(cluster: ClusterSpec, *, cp: int, tp: int) -> Link:
    """The link of a context-parallel group: ``cp`` consecutive dp ranks, ``tp`` apart (core/mesh.py
    ``group_ranks("cp")``), the slowest link it spans."""
    return cluster.link_for_group(cp, stride=tp)


@dataclass(frozen=True)
class CoreTensors:
    """One attention core's tensors, by node: what a ring or an all-to-all sends."""

    core: str
    first: str  # the core's first node (its exchanges are charged there)
    query: str
    keys: str  # before any expansion to the query's heads
    values: str
    output: str
    heads: int  # the query's heads (dim 1 of batch x heads x sequence x dim), 0 where unknown


def core_tensors(G: nx.DiGraph) -> tuple[CoreTensors, ...]:
    """Every attention core's query, keys, values and output (a fused attention op's inputs 0-2 and
    itself; written out, the scores matmul's inputs and the last matmul's second input and itself)."""
    cores: dict[str, list[str]] = {}
    for n, a in G.nodes(data=True):
        if a.get("attention_core"):
            cores.setdefault(a["attention_core"], []).append(n)
    out = []
    for core, nodes in cores.items():
        fused = [n for n in nodes if base_op(G.nodes[n]["op"]) in ATTENTION]
        if fused:
            n = fused[0]
            q, k, v = G.nodes[n]["inputs"][:3]
            o = n
        else:
            mm = [n for n in nodes if base_op(G.nodes[n]["op"]) in MATMUL]
            if len(mm) < 2:
                continue
            (q, k), v, o = G.nodes[mm[0]]["inputs"][:2], G.nodes[mm[-1]]["inputs"][1], mm[-1]
        shape = G.nodes[q]["shapes"][0] if G.nodes[q].get("shapes") else ()
        out.append(CoreTensors(core, nodes[0], q, _unexpanded(G, k), _unexpanded(G, v), o,
                               shape[1] if len(shape) == 4 else 0))
    return tuple(out)


def _unexpanded(G: nx.DiGraph, n: str) -> str:
    """``n`` or the smallest tensor it is a view, expansion or transpose of (repeat_kv's input)."""
    best = n
    while base_op(G.nodes[n]["op"]) in _VIEWS and G.nodes[n].get("inputs"):
        n = G.nodes[n]["inputs"][0]
        if G.nodes[n].get("out_bytes", 0) < G.nodes[best].get("out_bytes", 0):
            best = n
    return best


# -- one core's exchanges --------------------------------------------------------------


def ring_time(compute_s: float, exchange_bytes: float, cp: int, link: Link) -> float:
    """Seconds a ring adds to one core's ``compute_s`` (the rank's attention, all its blocks): the core
    runs as ``cp`` blocks of ``compute_s / cp``, and each of the ``cp - 1`` exchanges of
    ``exchange_bytes`` with the ring's neighbours (a send and a receive at once,
    ``collective_time("send_recv")``) runs beside one block (Megatron-LM's context parallelism;
    Liu et al., Ring Attention, 2023). The core takes sum over the steps of max(block, exchange) plus
    the last block: ``(cp - 1) x max(0, exchange - block)`` beyond its compute."""
    if cp <= 1:
        return 0.0
    block = compute_s / cp
    return (cp - 1) * max(0.0, collective_time("send_recv", exchange_bytes, 2, link) - block)


def all_to_all_time(sizes: Sequence[float], cp: int, link: Link) -> float:
    """Seconds of the all-to-alls of ``sizes`` bytes each (a rank's whole local tensor, S of
    ``collective_time("all_to_all")``) over the ``cp`` ranks, exposed (DeepSpeed-Ulysses, Jacobs et
    al., 2023)."""
    return sum(collective_time("all_to_all", s, cp, link) for s in sizes) if cp > 1 else 0.0


@dataclass(frozen=True)
class CoreExchange:
    """One core's calls on one rank per micro-batch, and the seconds they add to its forward and backward."""

    forward_s: float
    backward_s: float
    # (kind, bytes of one call, calls in forward, calls in backward, purpose)
    calls: tuple[tuple[str, float, int, int, str], ...]


def ring_exchange(kv_bytes: float, fwd_s: float, bwd_s: float, cp: int, link: Link,
                  grad_bytes: float | None = None) -> CoreExchange:
    """Forward: ``cp - 1`` exchanges of the rank's K and V (``kv_bytes``, one batched send each), each
    beside a block of the forward; backward: ``cp - 1`` of K and V again and ``cp - 1`` of the partial
    sums of their gradients (``grad_bytes``: K and V's elements in RING_GRAD_DTYPE; ``kv_bytes`` by
    default), beside blocks of the backward: the calls runtime/cp/attention.py makes."""
    grad_bytes = kv_bytes if grad_bytes is None else grad_bytes
    return CoreExchange(ring_time(fwd_s, kv_bytes, cp, link), ring_time(bwd_s, kv_bytes + grad_bytes, cp, link),
                        (("send_recv", kv_bytes, cp - 1, cp - 1, "ring attention: keys and values to the next cp "
                          "rank (again in backward)"),
                         ("send_recv", grad_bytes, 0, cp - 1,
                          "ring attention backward: the keys' and values' gradient sums towards their rank")))


def all_to_all_exchange(q_bytes: float, k_bytes: float, v_bytes: float, o_bytes: float, cp: int,
                        link: Link) -> CoreExchange:
    """Forward: four all-to-alls (q, k, v from sequence slices to heads, the output back); backward:
    four (the output's gradient to heads, those of q, k and v back), each of the rank's local tensor."""
    sizes = (q_bytes, k_bytes, v_bytes, o_bytes)
    t = all_to_all_time(sizes, cp, link)
    return CoreExchange(t, t, tuple(("all_to_all", s, 1, 1, f"all-to-all attention: {name} (and its gradient)")
                                    for s, name in zip(sizes, ("query", "keys", "values", "output"))))


def local_bytes(G: nx.DiGraph, c: CoreTensors, nbytes: Callable[[str], float], *, cp: int, tp: int,
                ) -> tuple[float, float, float, float]:
    """One rank's q, k, v and output bytes of core ``c`` (``nbytes``: a node's bytes at the micro-batch on
    one cp rank), split by heads over ``tp``."""
    q, k, v, o = (nbytes(n) / tp for n in (c.query, c.keys, c.values, c.output))
    return q, k, v, o


def a2a_kv_bytes(q: float, kv: float, heads: int, tp: int, cp: int) -> float:
    """K's (or V's) bytes an all-to-all sends: its local heads, at least ``cp`` of them (each rank of the
    cp group gets a whole head: grouped-query attention's are repeated up to that)."""
    if not heads:
        return kv
    per_head = q / max(heads // tp, 1)
    return max(kv, cp * per_head)


def core_exchange(strategy: str, G: nx.DiGraph, c: CoreTensors, nbytes: Callable[[str], float], *, cp: int, tp: int,
                  fwd_s: float, bwd_s: float, link: Link, grad_scale: float = 1.0) -> CoreExchange:
    """Core ``c``'s exchange under ``strategy`` (``fwd_s``/``bwd_s``: its own compute on the rank;
    ``grad_scale``: bytes of a ring's gradient element over an activation's, ``ring_grad_scale``)."""
    q, k, v, o = local_bytes(G, c, nbytes, cp=cp, tp=tp)
    if strategy == RING:
        return ring_exchange(k + v, fwd_s, bwd_s, cp, link, grad_scale * (k + v))
    return all_to_all_exchange(q, a2a_kv_bytes(q, k, c.heads, tp, cp), a2a_kv_bytes(q, v, c.heads, tp, cp), o, cp,
                               link)


def ring_grad_scale(request: TrainingRequest) -> float:
    """Bytes of an element of the ring's gradient sums (RING_GRAD_DTYPE) over an activation's."""
    return dtype_bytes(RING_GRAD_DTYPE) / element_bytes(request.precision)


def strategies(heads: int | None, tp: int, cp: int, pinned: str | None) -> tuple[str, ...]:
    """The attention strategies weighed: the pinned one, else ring and, where the heads (after tp)
    divide over cp (core/axes/context.py HEADS), all-to-all."""
    if pinned is not None:
        return (pinned,)
    return (RING, ALL_TO_ALL) if heads and heads % (tp * cp) == 0 else (RING,)


# -- the pipeline search's costs ------------------------------------------------------


def context_node_costs(costs: NodeCosts, G: nx.DiGraph, cp: int, *, tp: int, nbytes: Callable[[str], float],
                       link: Link, pinned: str | None = None, grad_scale: float = 1.0) -> NodeCosts:
    """``costs`` (one cp rank's, ``context_profile``'s) with each attention core's exchanges added to its
    first position: the ring's exposed part (``ring_time``) or the four all-to-alls each way, whichever
    is cheaper over the model's cores (or ``pinned``); the buffers each holds beside the core in its
    live bytes (a ring: K, V and, in backward, their gradients, received while the current block
    computes: 2 x 2 x kv; all-to-all: the q, k, v and output it gathered). The strategy is recorded
    (``NodeCosts.cp_attention``) and each position's seconds (``context_s``)."""
    if cp <= 1:
        return costs
    at = {n: i for i, n in enumerate(costs.order)}
    cores = core_tensors(G)
    heads = min((c.heads for c in cores if c.heads), default=None)
    span: dict[str, tuple[float, float]] = {}
    for i, core in enumerate(costs.cores):
        if core:
            f, b = span.get(core, (0.0, 0.0))
            span[core] = (f + costs.forward_s[i], b + costs.backward_s[i])
    priced = {}
    for s in strategies(heads, tp, cp, pinned):
        priced[s] = [core_exchange(s, G, c, nbytes, cp=cp, tp=tp, fwd_s=span.get(c.core, (0, 0))[0],
                                   bwd_s=span.get(c.core, (0, 0))[1], link=link, grad_scale=grad_scale)
                     for c in cores]
    chosen = min(priced, key=lambda s: (sum(x.forward_s + x.backward_s for x in priced[s]), CP_ATTENTION.index(s)))
    fwd, bwd, live = list(costs.forward_s), list(costs.backward_s), list(costs.live_bytes or [0] * len(costs.order))
    extra = [(0.0, 0.0)] * len(costs.order)
    for c, x in zip(cores, priced[chosen]):
        i = at[c.first]
        q, k, v, o = local_bytes(G, c, nbytes, cp=cp, tp=tp)
        fwd[i], bwd[i] = fwd[i] + x.forward_s, bwd[i] + x.backward_s
        extra[i] = (extra[i][0] + x.forward_s, extra[i][1] + x.backward_s)
        live[i] += round(4 * (k + v) if chosen == RING else q + k + v + o)
    return dataclasses.replace(costs, forward_s=tuple(fwd), backward_s=tuple(bwd), live_bytes=tuple(live),
                               context_s=tuple(extra), cp_attention=chosen)


def context_costs(build: Callable[[int], NodeCosts], view: ModelProfile, request: TrainingRequest,
                  cluster: ClusterSpec, cp: int, *, tp: int, pinned: str | None = None
                  ) -> Callable[[int], NodeCosts]:
    """``build`` (micro-batch -> one cp rank's per-node costs) with the cores' exchanges
    (``context_node_costs``) on the cp group's link: the pipeline search's costs at cp. ``view``: the
    profile as one cp rank sees it (``context_profile``)."""
    link = cp_link(cluster, cp=cp, tp=tp)
    return lambda mb: context_node_costs(build(mb), view.graph, cp, tp=tp, link=link, pinned=pinned,
                                         nbytes=output_bytes(view, request, mb), grad_scale=ring_grad_scale(request))


# -- a step's parts and the plan's calls ----------------------------------------------------


def stage_context_s(costs: NodeCosts, node_stage: Mapping[str, int], recomputes: Sequence[bool]) -> list[float]:
    """Per (virtual) stage, one micro-batch's exchange seconds on its rank (``context_s`` of the cores it
    holds); a stage that reruns its cores in backward (any recomputation) runs their forward's again."""
    out = [0.0] * len(recomputes)
    for n, (f, b) in zip(costs.order, costs.context_s or ()):
        s = node_stage.get(n, 0)
        out[s] += f + b + (f if recomputes[s] else 0.0)
    return out


def context_parts(compute_s: float, comm: Mapping[str, float], per_stage: Sequence[float], strategy: str,
                  slowest_stage: int, pp: int, micro_batches: int) -> tuple[float, dict[str, float]]:
    """A step's compute and communication with the exchanges told apart: the slowest rank's micro-batches'
    exchange seconds out of its compute (its slots hold them: ``context_node_costs``)."""
    exposed = micro_batches * sum(per_stage[slowest_stage::pp])
    return compute_s - exposed, {**comm, CP_KEYS[strategy]: exposed} if exposed > 1e-12 else dict(comm)


def context_calls(view: ModelProfile, request: TrainingRequest, cluster: ClusterSpec, *, cp: int, tp: int,
                  micro_batch: int, strategy: str, held: Callable[[str], bool] = lambda core: True,
                  recompute: bool = False) -> list[tuple[str, float, int, str, float]]:
    """One micro-batch's cp calls on one rank over the model's cores (those ``held``), merged by (kind,
    bytes, purpose): (kind, bytes of one call, calls, purpose, seconds of one call on the cp group's
    link); ``recompute``: the cores' forward rerun in backward, its calls again. ``view``: the profile
    as one cp rank sees it (``context_profile``)."""
    nbytes = output_bytes(view, request, micro_batch)
    link = cp_link(cluster, cp=cp, tp=tp)
    merged: dict[tuple[str, int, str], int] = {}
    for c in core_tensors(view.graph):
        if not held(c.core):
            continue
        x = core_exchange(strategy, view.graph, c, nbytes, cp=cp, tp=tp, fwd_s=0.0, bwd_s=0.0, link=link,
                          grad_scale=ring_grad_scale(request))
        for kind, size, forward, backward, purpose in x.calls:
            key = (kind, round(size), purpose)
            merged[key] = merged.get(key, 0) + forward * (2 if recompute else 1) + backward
    return [(kind, size, n, purpose, collective_time(kind, size, cp if kind == "all_to_all" else 2, link))
            for (kind, size, purpose), n in merged.items()]


def context_traffic(calls: Sequence[tuple[str, float, int, str, float]], cp: int, micro_batches: int) -> int:
    """Bytes one rank sends per step in ``calls`` (``context_calls``) over ``micro_batches`` micro-batches."""
    return round(micro_batches * sum(n * collective_traffic(kind, size, cp if kind == "all_to_all" else 2)
                                     for kind, size, n, _, _ in calls))


def cp_degrees(world_per_stage: int, sequence: int | None) -> list[int]:
    """The context-parallel degrees weighed unpinned where the sequence binds memory: the divisors above
    1 of the data-parallel ranks a stage could have whose double divides the sequence (each rank holds
    two mirrored chunks: core/axes/context.py SEQUENCE)."""
    if not sequence:
        return []
    return [c for c in range(2, world_per_stage + 1) if world_per_stage % c == 0 and sequence % (2 * c) == 0]


# -- the search's choice (passes/search.py) --------------------------------------------------


def sequence_binds(options: Sequence[Any], facts: Mapping[str, Any], request: TrainingRequest,
                    pins: Pins) -> bool:
    """Whether the sequence binds memory, so that context parallelism is weighed: nothing fits, or the
    fastest plan runs micro-batches of one sample and still recomputes or offloads (a smaller batch
    cannot relieve it; only splitting the sequence can). Only for training a model with an attention
    core, a sequence, and no experts (core/axes/context.py: not beside ep)."""
    if (request.inference or not facts.get("attention_core") or not facts.get("sequence") or facts.get("experts")
            or (pins.ep or 1) > 1):
        return False
    if not options:
        return True
    best = min(options, key=lambda o: o.step_s)
    return best.micro_batch_size == 1 and binds_memory(best)


def cp_queue(cluster: ClusterSpec, world: int, pins: Pins, facts: Mapping[str, Any], request: TrainingRequest,
              residual: bool) -> list[tuple[int, bool, Pins]]:
    """The pipeline searches context parallelism is weighed by: each tp, each cp of passes/context.py
    ``cp_degrees`` that the axis's rules allow (core/axes/context.py), the residual stream split where
    tp > 1 (memory binds) unless pinned off."""
    queue = []
    for tp in tp_degrees(cluster, world, pins, pp=pins.pp):
        for cp in cp_degrees(world // tp // (pins.pp or 1), facts.get("sequence")):
            at = replace(pins, cp=cp)
            try:
                check_pins(replace(at, tp=tp), inference=request.inference, facts=facts)
            except PartitaError:
                continue  # a rule refuses it here (the heads under a pinned all-to-all, the sequence)
            queue.append((tp, tp > 1 and residual and pins.sequence_parallel is not False, at))
    return queue


def cp_note(best: Any, options: Sequence[Any], pins: Pins) -> tuple[str, ...]:
    """Why the plan splits its sequences (or, where it was weighed, why not), in words."""
    if best.mesh.cp == 1:
        split = [o for o in options if o.mesh.cp > 1]
        if not split:
            return ()
        fastest = min(split, key=lambda o: o.step_s)
        return (f"context parallelism weighed (the sequence binds memory) and not taken: the best split plan, "
                f"{fastest.mesh} by {fastest.cp_attention}, is {fastest.step_s / best.step_s:.2f}x the step",)
    if pins.cp is not None:
        return (f"cp={best.mesh.cp} pinned, attention by {best.cp_attention}",)
    whole = [o for o in options if o.mesh.cp == 1]
    if not whole:
        why = "no plan without it fits memory"
    else:
        w = min(whole, key=lambda o: o.step_s)
        held = [f"recomputes ({', '.join(sorted({s.recompute for s in w.stages if s.recompute != NONE}))})"] \
            if recomputes(w) else []
        held += ["offloads the optimizer's state"] if w.offload != NO_OFFLOAD else []
        why = (f"the best plan without it ({w.mesh}, micro-batch {w.micro_batch_size}) {' and '.join(held)} to fit "
               f"memory and takes {w.step_s / best.step_s:.2f}x the step")
    return (f"context parallelism chosen: cp={best.mesh.cp}, each sequence split over {best.mesh.cp} ranks, attention "
            f"by {best.cp_attention}; the sequence binds memory: {why}",)
