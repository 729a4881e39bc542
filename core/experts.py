"""Mixture-of-experts layers in a captured graph: where tokens meet their experts.

Hugging Face's MoE experts (Mixtral, OLMoE, Qwen2-MoE) sort a layer's token rows by the expert
they were routed to, count the rows per expert, and run each expert's weights over its rows with
grouped matmuls that share one offsets tensor (the counts' running sum):
``aten._grouped_mm(rows, weights, offs)`` or, where torch has no usable kernel,
``transformers::grouped_mm_fallback(rows, weights, offs)``. The weights are parameters of shape
``(experts, ...)``.

``expert_regions(graph)`` finds each such layer as an ``ExpertRegion``: its offsets node, its
grouped matmuls (the first reads the sorted rows, the last returns the expert outputs), the
parameters stacked over experts, and the nodes between that hold a rank's own rows or experts
only, once expert parallelism splits the experts over the "ep" group. The planner prices the
dispatch from it (passes/experts.py) and the runtime rewrites the same nodes
(runtime/experts.py); the rule of what an expert layer is lives here alone. A plan's node
decisions record the same ops and inputs, so `partita verify` finds which modules hold expert
weights without the model (``decided_expert_modules``), by the same walk. What this version runs
beside expert parallelism (``ep_conflicts``) is here too: the planner refuses such a pin, verify
such a plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partita.core.errors import PartitaError
from partita.core.model.ops import op_name, tensor_values

if TYPE_CHECKING:  # torch is imported by the functions that read fx nodes: the plan's checks run without it
    import torch.fx

_GROUPED = ("_grouped_mm", "grouped_mm_fallback")


def is_grouped_mm_op(op: str) -> bool:
    """Whether ``op`` (core/model/ops.py ``op_name``: ``"aten._grouped_mm.default"``,
    ``"transformers.grouped_mm_fallback.default"``) names a grouped matmul over experts."""
    return any(part in _GROUPED for part in op.split("."))


def is_grouped_mm(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a grouped matmul over experts (module docstring) with an offsets argument."""
    import torch.fx

    if n.op != "call_function":
        return False
    offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
    return is_grouped_mm_op(op_name(n)) and isinstance(offs, torch.fx.Node)


def _offsets(n: torch.fx.Node) -> torch.fx.Node:
    return n.args[2] if len(n.args) > 2 else n.kwargs["offs"]


@dataclass(frozen=True)
class ExpertRegion:
    """One MoE layer's experts in the captured graph (module docstring). Row counts are at the
    captured batch; the dispatched rows are ``rows x row_bytes`` and come back as ``rows x out_bytes``."""

    offsets: str  # the cumulative rows per expert
    matmuls: tuple[str, ...]  # its grouped matmuls, in graph order
    weights: tuple[str, ...]  # parameter placeholders stacked over experts (dim 0)
    experts: int
    rows: int  # token rows dispatched (tokens x experts per token)
    row_bytes: int  # bytes of one dispatched row, at the captured dtype
    out_bytes: int  # bytes of one returned row
    local: frozenset[str]  # nodes whose values hold a rank's own rows or experts under expert parallelism
    # per-row values made outside the layer and read inside it (a bias gathered by expert id, a per-row
    # scale): (the reading node, the value's node, bytes of one row). Under expert parallelism they
    # travel with the rows, along the same route, so each meets its own row on the expert's rank
    carried: tuple[tuple[str, str, int], ...] = ()
    chains: frozenset[str] = frozenset()  # the ops between a stacked weight and its matmul (views, transposes)

    @property
    def first(self) -> str:
        return self.matmuls[0]

    @property
    def last(self) -> str:
        return self.matmuls[-1]


def _viewed(name: str, op_of: Callable[[str], str | None],
            inputs_of: Callable[[str], Sequence[str]]) -> tuple[str | None, list[str]]:
    """The placeholder node ``name`` views (through single-input ops: ``transpose``, ``to``), and the
    chain of nodes from it to ``name``; None where a node on the way reads several inputs or none
    (or, in an edited plan, loops). ``op_of``: a node's op (``"placeholder"`` for one; None: no such
    node), ``inputs_of`` its inputs' names: the graph's (``expert_regions``) or a plan's decisions'
    (``decided_expert_modules``)."""
    chain: list[str] = []
    while op_of(name) != "placeholder":
        chain.append(name)
        inputs = inputs_of(name) if op_of(name) is not None else ()
        if len(inputs) != 1 or inputs[0] in chain:
            return None, chain
        name = inputs[0]
    return name, chain


def expert_regions(graph: torch.fx.Graph, params: Iterable[str]) -> list[ExpertRegion]:
    """The MoE layers of ``graph`` (module docstring): grouped matmuls grouped by their offsets node,
    each layer's weights among ``params`` (the parameter placeholders' names). A grouped matmul whose
    weight is not a parameter stacked over experts is no expert layer (nothing of it splits)."""
    import torch

    params = set(params)
    nodes = {n.name: n for n in graph.nodes}
    by_offsets: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if is_grouped_mm(n):
            by_offsets.setdefault(_offsets(n), []).append(n)
    regions = []
    for offs, matmuls in by_offsets.items():
        experts = tuple(offs.meta["val"].shape)[0] if isinstance(offs.meta.get("val"), torch.Tensor) else 0
        weights: list[str] = []
        local: set[str] = set()
        chains: set[str] = set()
        ok = experts > 0
        for m in matmuls:
            w, chain = _viewed(m.args[1].name, lambda x: nodes[x].op,
                               lambda x: [a.name for a in nodes[x].all_input_nodes])
            shape = tuple(m.args[1].meta["val"].shape) if isinstance(m.args[1].meta.get("val"), torch.Tensor) else ()
            if w not in params or not shape or shape[0] != experts:
                ok = False
                break
            weights.append(w)
            local.update(chain)
            chains.update(chain)
        if not ok:
            continue
        first, last = matmuls[0], matmuls[-1]
        # rows a rank holds of its own experts: from each matmul (DBRX's gate and up read the rows side
        # by side) to the last, and what lies between
        below = set().union(*(_reach(m, down=True) | {m} for m in matmuls))
        between = below & (_reach(last, down=False) | {last})
        local.update(c.name for c in between)
        rows_in = tensor_values(first.args[0].meta.get("val"))[0]
        rows_out = tensor_values(last.meta.get("val"))[0]
        carried = _carried(between | {first, last}, matmuls, int(rows_in.shape[0]))
        regions.append(ExpertRegion(
            offsets=offs.name, matmuls=tuple(m.name for m in matmuls), weights=tuple(dict.fromkeys(weights)),
            experts=experts, rows=int(rows_in.shape[0]),
            row_bytes=int(rows_in[0].numel() * rows_in.element_size()),
            out_bytes=int(rows_out[0].numel() * rows_out.element_size()), local=frozenset(local), carried=carried,
            chains=frozenset(chains)))
    return regions


def _carried(inside: set[torch.fx.Node], matmuls: list[torch.fx.Node], rows: int) -> tuple[tuple[str, str, int], ...]:
    """The per-row values an MoE layer's nodes ``inside`` read from outside it (``ExpertRegion.carried``):
    a tensor whose first dimension is the layer's ``rows``, that is neither the rows the first grouped
    matmul reads (dispatched already) nor a weight or offsets of a grouped matmul."""
    import torch

    # what the grouped matmuls read as such: the first one's rows, every one's weights and offsets
    rows_in = matmuls[0].args[0]  # dispatched once, read by every matmul that reads the layer's rows
    own = {(m, a) for m in matmuls for a in m.all_input_nodes if a is not m.args[0] or a is rows_in}
    out = []
    for n in sorted(inside, key=lambda x: x.name):
        for a in n.all_input_nodes:
            val = a.meta.get("val")
            if (a in inside or (n, a) in own or not isinstance(val, torch.Tensor) or val.dim() == 0
                    or int(val.shape[0]) != rows):
                continue
            out.append((n.name, a.name, int(val[0].numel() * val.element_size())))
    return tuple(out)


def _reach(n: torch.fx.Node, *, down: bool) -> set[torch.fx.Node]:
    """The nodes ``n`` leads to (``down``: its users, theirs...), or (not ``down``) those leading to it."""
    seen: set[torch.fx.Node] = set()
    frontier = [n]
    while frontier:
        m = frontier.pop()
        for v in (m.users if down else m.all_input_nodes):
            if v not in seen:
                seen.add(v)
                frontier.append(v)
    return seen


def ep_degrees(regions: Iterable[ExpertRegion], dp: int) -> list[int]:
    """The expert-parallel degrees a data-parallel group of ``dp`` ranks can take: divisors of
    ``dp`` that divide every layer's expert count (each rank holds whole experts). [1] without
    experts."""
    counts = {r.experts for r in regions}
    if not counts:
        return [1]
    return [e for e in range(1, dp + 1) if dp % e == 0 and all(c % e == 0 for c in counts)]


def expert_params(regions: Iterable[ExpertRegion], param_nodes: dict[str, str]) -> set[str]:
    """The qualified names of the parameters stacked over experts (``param_nodes``: placeholder ->
    qualified name)."""
    return {param_nodes[w] for r in regions for w in r.weights if w in param_nodes}


def decided_expert_modules(decisions: Iterable[Any]) -> set[str]:
    """The modules holding a parameter that a plan's grouped matmuls read as their weights
    (``expert_regions``' walk, over the decisions' ``op`` and tensor inputs ``ins`` in argument order,
    as the graph has them): where its expert weights may live. A plan records no placeholder's
    parameter name, only its module (core/model/graph.py), hence modules, not parameters."""
    decided = {d.name: d for d in decisions}

    def op_of(name: str) -> str | None:
        d = decided.get(name)
        return d.op if d is not None else None

    out = set()
    for d in decided.values():
        if is_grouped_mm_op(d.op) and len(d.ins) > 2:  # rows, weights, offsets
            w, _ = _viewed(d.ins[1].src, op_of, lambda x: [lay.src for lay in decided[x].ins])
            if w is not None:
                out.add(decided[w].module)
    return out


# What this version runs expert parallelism beside: a training plan at tp = 1, without offload or
# sequence parallelism (runtime/experts.py, docs/runtime.md "Expert parallelism").
EP_RUNS = "in a training plan at tp=1, without offload or sequence parallelism"


def ep_conflicts(*, inference: bool, tp: int, offload: bool, sequence_parallel: bool) -> list[str]:
    """The settings among these that rule out expert parallelism (``EP_RUNS``), by name:
    ``"inference"``, ``"tp"``, ``"offload"``, ``"sequence_parallel"``; [] where ep > 1 may run."""
    return [name for name, on in (("inference", inference), ("tp", tp > 1), ("offload", offload),
                                  ("sequence_parallel", sequence_parallel)) if on]


# -- routing: how evenly a layer's rows fall on the ranks of an expert group ------------------------

ROUTER_PROFILE = "partita router profile"  # the ``kind`` of the file `partita calibrate --router` writes
LOAD_HINT = ("pin --expert-load with a number >= 1 (the slowest expert rank's rows over the mean), or a "
             "router profile written by `partita calibrate --router`")
BALANCED = ("assumed balanced: every rank of an expert group gets the mean rows (pin --expert-load, or "
            "measure the router with `partita calibrate --router`)")


def rank_load(counts: Sequence[int], ep: int) -> float:
    """The slowest of ``ep`` expert ranks' rows over the mean, for one MoE layer whose experts got
    ``counts`` rows each, the experts placed as core/mesh.py ``held_experts`` places them: 1 balanced,
    ``ep`` at most (every row on one rank); 1 at ep = 1 (each rank runs every expert on its own rows)."""
    from partita.core.mesh import held_experts

    total = sum(counts)
    if ep <= 1 or total <= 0:
        return 1.0
    return max(sum(counts[e] for e in held_experts(len(counts), ep, i)) for i in range(ep)) * ep / total


@dataclass(frozen=True)
class ExpertLoad:
    """What the planner takes routing to be: ``factor`` pinned (the slowest expert rank's rows over
    the mean, at every ep > 1, at most ep), or ``counts`` measured (each MoE layer's rows per
    expert, in graph order, by `partita calibrate --router`), or neither: balanced. ``source`` says
    which, in the report's words."""

    factor: float | None = None
    counts: tuple[tuple[int, ...], ...] | None = None
    source: str = BALANCED

    def loads(self, experts: Sequence[int], ep: int) -> tuple[float, ...]:
        """Each MoE layer's load at ``ep`` (``experts``: each layer's expert count, in graph order):
        the slowest rank of its expert group over the mean (``rank_load``)."""
        if self.counts is not None and [len(c) for c in self.counts] != list(experts):
            raise PartitaError(
                f"the router profile has {len(self.counts)} MoE layer(s) of "
                f"{'/'.join(str(len(c)) for c in self.counts) or 'no'} experts, the model {len(experts)} of "
                f"{'/'.join(map(str, experts)) or 'no'}: it was measured on another model", hint=LOAD_HINT)
        if ep <= 1:
            return (1.0,) * len(experts)
        if self.counts is not None:
            return tuple(rank_load(c, ep) for c in self.counts)
        return (min(self.factor or 1.0, float(ep)),) * len(experts)


def expert_load(value: str | float | None) -> ExpertLoad:
    """A ``--expert-load`` pin as the planner takes it: a number >= 1, or the path of a router profile
    (`partita calibrate --router`); None: balanced. Refused, in the CLI's words, otherwise."""
    if value is None:
        return ExpertLoad()
    try:
        factor = float(value)
    except ValueError:
        import os

        try:  # read once per version of the file (the search asks at every candidate)
            stamp = os.stat(value).st_mtime_ns
        except (OSError, ValueError):
            stamp = None  # read_user_text names what is wrong
        return _read_profile(str(value), stamp)
    if not factor >= 1 or factor == float("inf"):
        raise PartitaError(f"--expert-load {value} must be a number >= 1: the slowest expert rank's rows over "
                           "the mean (1: balanced)", hint=LOAD_HINT)
    return ExpertLoad(factor=factor, source=f"pinned: --expert-load {factor:g}, the slowest rank of each expert "
                                            f"group running {factor:g}x the mean rows (at most ep)")


@functools.lru_cache(maxsize=16)
def _read_profile(path: str, stamp: int | None) -> ExpertLoad:
    """A router profile (``router_profile``'s JSON), each field checked (``stamp``: its modification
    time, so that a file written again is read again)."""
    import json
    import os

    from partita.core.files import read_user_text

    text = read_user_text(path, what="router profile", limit=1 << 24, hint=LOAD_HINT)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PartitaError(f"{path} is not a router profile: {e}", hint=LOAD_HINT) from e
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("kind") != ROUTER_PROFILE or not isinstance(layers, list) or not all(
            isinstance(x, dict) and isinstance(x.get("counts"), list) and x["counts"] and all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in x["counts"]) for x in layers):
        raise PartitaError(f"{path} is not a router profile: it needs \"kind\": \"{ROUTER_PROFILE}\" and \"layers\", "
                           "each with \"counts\", the rows routed to each expert (whole numbers >= 0)",
                           hint=LOAD_HINT)
    counts = tuple(tuple(x["counts"]) for x in layers)
    tokens = data.get("tokens")
    return ExpertLoad(counts=counts, source=f"measured: {os.path.basename(path)}, the router's choices on "
                                            f"{tokens if isinstance(tokens, int) else 'a batch of'} tokens "
                                            f"({data.get('model', 'a model')}), {len(counts)} MoE layer(s)")


def router_profile(counts: Sequence[Sequence[int]], *, tokens: int, model: str, layers: Sequence[str]) -> dict:
    """The router profile `partita calibrate --router` writes: each MoE layer's rows per expert."""
    return {"kind": ROUTER_PROFILE, "model": model, "tokens": tokens,
            "layers": [{"layer": name, "counts": [int(c) for c in cs]} for name, cs in zip(layers, counts)]}
