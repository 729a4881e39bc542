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
(runtime/experts.py); the rule of what an expert layer is lives here alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx

from partita.core.ops import tensor_values

_GROUPED = ("_grouped_mm", "grouped_mm_fallback")


def is_grouped_mm(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a grouped matmul over experts (module docstring) with an offsets argument."""
    if n.op != "call_function":
        return False
    name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
    offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
    return name in _GROUPED and isinstance(offs, torch.fx.Node)


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

    @property
    def first(self) -> str:
        return self.matmuls[0]

    @property
    def last(self) -> str:
        return self.matmuls[-1]


def _weight_param(n: torch.fx.Node, params: Iterable[str]) -> tuple[str | None, list[torch.fx.Node]]:
    """The parameter placeholder ``n`` views (through single-input ops: ``transpose``, ``to``), and
    the chain of nodes from it to ``n``."""
    chain: list[torch.fx.Node] = []
    params = set(params)
    while n.op != "placeholder":
        chain.append(n)
        inputs = n.all_input_nodes
        if len(inputs) != 1:
            return None, chain
        n = inputs[0]
    return (n.name if n.name in params else None), chain


def expert_regions(graph: torch.fx.Graph, params: Iterable[str]) -> list[ExpertRegion]:
    """The MoE layers of ``graph`` (module docstring): grouped matmuls grouped by their offsets node,
    each layer's weights among ``params`` (the parameter placeholders' names). A grouped matmul whose
    weight is not a parameter stacked over experts is no expert layer (nothing of it splits)."""
    params = set(params)
    by_offsets: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if is_grouped_mm(n):
            by_offsets.setdefault(_offsets(n), []).append(n)
    regions = []
    for offs, matmuls in by_offsets.items():
        experts = tuple(offs.meta["val"].shape)[0] if isinstance(offs.meta.get("val"), torch.Tensor) else 0
        weights: list[str] = []
        local: set[str] = set()
        ok = experts > 0
        for m in matmuls:
            w, chain = _weight_param(m.args[1], params)
            shape = tuple(m.args[1].meta["val"].shape) if isinstance(m.args[1].meta.get("val"), torch.Tensor) else ()
            if w is None or not shape or shape[0] != experts:
                ok = False
                break
            weights.append(w)
            local.update(c.name for c in chain)
        if not ok:
            continue
        first, last = matmuls[0], matmuls[-1]
        # rows a rank holds of its own experts: from the first matmul to the last, and what lies between
        between = (_reach(first, down=True) | {first}) & (_reach(last, down=False) | {last})
        local.update(c.name for c in between)
        rows_in = tensor_values(first.args[0].meta.get("val"))[0]
        rows_out = tensor_values(last.meta.get("val"))[0]
        regions.append(ExpertRegion(
            offsets=offs.name, matmuls=tuple(m.name for m in matmuls), weights=tuple(dict.fromkeys(weights)),
            experts=experts, rows=int(rows_in.shape[0]),
            row_bytes=int(rows_in[0].numel() * rows_in.element_size()),
            out_bytes=int(rows_out[0].numel() * rows_out.element_size()), local=frozenset(local)))
    return regions


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
