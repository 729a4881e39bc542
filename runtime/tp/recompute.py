"""Activation recomputation (``Stage.recompute``): which nodes rerun in backward, and how.

On a stage that recomputes, each maximal run of consecutive nodes (program
order) of one repeated layer (``NodeDecision.layer``, e.g. "transformer.h.3")
is a ``Region``, run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
(``run_recomputed``): forward keeps only the region's inputs (the values it
reads from outside, parameters included) and its outputs (the values read
outside it: by later nodes, the output node or, in a pipeline, another stage,
which the stage sends), and backward reruns the region's forward to rebuild
what its backward needs. Nodes outside the layers (embeddings, final norm,
head, loss) run as usual. The rerun is the region's whole forward
(``early_stop=False``), so its reshards and op-internal collectives run once
more per micro-batch, exactly the forward-side ones of the recomputed nodes, as
the plan lists them and as Megatron does; the RNG state is restored for the
rerun, so dropout draws the same mask. Only while gradients are enabled: an
inference forward runs the nodes plainly. Not with ZeRO-3
(compose.refuse_unsupported): the rerun would gather and release parameters
under views the recomputed forward has just saved.

The interpreter (runtime/tp/interpreter.py) runs a region's nodes; this file
decides the regions and wraps their forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint

from partita.core.plan import Plan


def recomputed_layers(plan: Plan) -> dict[str, str]:
    """Node name -> its repeated layer, for the layer nodes of the stages that recompute."""
    stages = {s.index for s in plan.stages if s.recompute}
    return {d.name: d.layer for d in plan.nodes if d.layer and d.stage in stages}


@dataclass(frozen=True)
class Region:
    """Consecutive nodes of one recomputed layer, what they read from outside, what is read of them."""

    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]  # values produced outside the region that its nodes read
    outputs: tuple[torch.fx.Node, ...]  # its nodes with a user outside it (anywhere in the graph)


def _region(run: list[torch.fx.Node]) -> Region:
    inside = set(run)
    inputs = dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    return Region(tuple(run), tuple(inputs), tuple(outputs))


def recompute_regions(nodes: Sequence[torch.fx.Node], layer_of: Mapping[str, str]
                      ) -> list[torch.fx.Node | Region]:
    """``nodes`` in order, each maximal run of consecutive call nodes of one layer in
    ``layer_of`` (``recomputed_layers``) grouped into a ``Region``."""
    out: list[torch.fx.Node | Region] = []
    run: list[torch.fx.Node] = []
    for n in nodes:
        layer = layer_of.get(n.name, "") if n.op == "call_function" else ""
        if run and layer != layer_of[run[-1].name]:
            out.append(_region(run))
            run = []
        if layer:
            run.append(n)
        else:
            out.append(n)
    if run:
        out.append(_region(run))
    return out


def run_recomputed(forward: Callable[..., tuple[Any, ...]], values: Sequence[Any]) -> tuple[Any, ...]:
    """``forward(*values)``, its intermediates dropped and rebuilt by rerunning it in backward."""
    if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
        return forward(*values)
    # The whole forward again, no early stop: stopping once the saved tensors are rebuilt
    # would skip a layer's trailing reshards (its row-parallel all-reduce), which the plan
    # lists twice; and the stop is an exception that run_node would report as a failure.
    return torch.utils.checkpoint.checkpoint(forward, *values, use_reentrant=False, early_stop=False)


class RegionCache:
    """A node list with its recomputed layers grouped, computed once per list."""

    def __init__(self, plan: Plan) -> None:
        self.layers = recomputed_layers(plan)  # node -> layer, on the stages that recompute
        self._regions: dict[tuple[str, ...], list[torch.fx.Node | Region]] = {}

    def __call__(self, nodes: list[torch.fx.Node]) -> list[torch.fx.Node | Region]:
        if not self.layers:  # nothing recomputes: every micro-batch runs the list as it is
            return nodes
        key = tuple(n.name for n in nodes)
        if key not in self._regions:
            self._regions[key] = recompute_regions(nodes, self.layers)
        return self._regions[key]
