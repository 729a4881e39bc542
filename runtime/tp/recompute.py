"""Activation recomputation (``Stage.recompute``): which nodes rerun in backward, and how.

On a stage that recomputes, each maximal run of consecutive nodes (program order) of one
rerun region (core/recompute.py ``rerun_regions``: under "full" a repeated layer,
``NodeDecision.layer``, e.g. "transformer.h.3"; under "selective" a layer's attention core)
is a ``Region``, run by ``run_recomputed``: forward runs it without autograd
and keeps only the region's inputs (the values it reads from outside,
parameters included) and its outputs (the values read outside it: by later
nodes, the output node or, in a pipeline, another stage, which the stage
sends); backward reruns the region's forward with autograd, under the same
autocast, and back-propagates through it (reentrant checkpointing: one autograd
node per region, where torch's non-reentrant checkpoint adds a Python hook per
saved tensor). Nodes outside the layers (embeddings, final norm,
head, loss) run as usual. The rerun is the region's whole forward
(``early_stop=False``), so its reshards and op-internal collectives run once
more per micro-batch, exactly the forward-side ones of the recomputed nodes, as
the plan lists them and as Megatron does; random ops are seeded per op
(runtime/rng.py), so the rerun's dropout draws the same mask. Only while gradients are enabled: an
inference forward runs the nodes plainly. Not with ZeRO-3
(compose.refuse_unsupported): the rerun would gather and release parameters
under views the recomputed forward has just saved.

The rank's program (runtime/tp/program.py) runs a region's nodes as a sub-program; this file
decides the regions and wraps their forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.core.plan import Plan
from partita.core.recompute import rerun_regions


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
    """``nodes`` in order, each maximal run of consecutive call nodes of one region in
    ``layer_of`` (core/recompute.py ``rerun_regions``) grouped into a ``Region``."""
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


def run_recomputed(forward: Callable[..., Any], values: Sequence[Any],
                   autocast: Callable[[], Any] = contextlib.nullcontext) -> Any:
    """``forward(*values)``, its intermediates dropped and rebuilt by rerunning it in backward
    (under ``autocast()``, the context the forward runs in)."""
    if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
        return forward(*values)
    # Parameters (leaves that want a gradient) are not inputs of the autograd node: the rerun
    # reads them as they are and its backward accumulates their gradients (and fires their
    # hooks) once; were they inputs, the node would also hand them an empty gradient.
    held = {i: v for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.requires_grad and v.is_leaf}
    passed = [None if i in held else v for i, v in enumerate(values)]
    # the outputs must want a gradient when only parameters do (a region reading token ids)
    anchor = _ANCHOR if held and not any(isinstance(v, torch.Tensor) and v.requires_grad for v in passed) else None
    box: dict[str, Any] = {}  # the output's structure and its non-tensor leaves, from the forward
    tensors = iter(_Recompute.apply(forward, autocast, box, held, anchor, *passed))
    leaves = [next(tensors) if v is _TENSOR else v for v in box["leaves"]]
    return pytree.tree_unflatten(leaves, box["spec"])


_TENSOR = object()  # a tensor leaf's place in ``box["leaves"]``
_ANCHOR = torch.empty(0, requires_grad=True)  # makes the node's outputs want a gradient


class _Recompute(torch.autograd.Function):
    """One autograd node for a recomputed region: forward without autograd, keeping its inputs;
    backward reruns it with autograd and back-propagates the outputs' gradients through it,
    returning those of the inputs (detached for the rerun) and accumulating the parameters'."""

    @staticmethod
    def forward(ctx: Any, forward: Callable[..., Any], autocast: Callable[[], Any], box: dict[str, Any],
                held: dict[int, torch.Tensor], anchor: torch.Tensor | None, *passed: Any) -> tuple[torch.Tensor, ...]:
        ctx.forward, ctx.autocast, ctx.held = forward, autocast, held
        ctx.tensor_at = [i for i, v in enumerate(passed) if isinstance(v, torch.Tensor)]
        ctx.values = [held.get(i) if v is None else (None if isinstance(v, torch.Tensor) else v)
                      for i, v in enumerate(passed)]
        ctx.save_for_backward(*(passed[i] for i in ctx.tensor_at))
        values = [held.get(i, v) for i, v in enumerate(passed)]
        leaves, box["spec"] = pytree.tree_flatten(forward(*values))
        box["leaves"] = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return tuple(v for v in leaves if isinstance(v, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        values = list(ctx.values)
        detached: dict[int, torch.Tensor] = {}
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            values[i] = detached[i] = t.detach().requires_grad_(t.requires_grad)
        with torch.enable_grad(), ctx.autocast():
            out = ctx.forward(*values)
        outs = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, None,
                *(detached[i].grad if i in detached else None for i in range(len(values))))


class RegionCache:
    """A node list with its recomputed layers grouped, computed once per list."""

    def __init__(self, plan: Plan, nodes: Iterable[torch.fx.Node], state: Collection[str]) -> None:
        # node -> the region it reruns in (its layer or attention core), on the stages that recompute
        self.layers = rerun_regions(plan.stages, plan.nodes, nodes, state)
        self._regions: dict[tuple[str, ...], list[torch.fx.Node | Region]] = {}

    def __call__(self, nodes: list[torch.fx.Node]) -> list[torch.fx.Node | Region]:
        if not self.layers:  # nothing recomputes: every micro-batch runs the list as it is
            return nodes
        key = tuple(n.name for n in nodes)
        if key not in self._regions:
            self._regions[key] = recompute_regions(nodes, self.layers)
        return self._regions[key]
