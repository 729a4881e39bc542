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
from torch.autograd.variable import Variable

from partita.core.plans.plan import Plan
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
    # Only the activations are inputs of the autograd node. Parameters (leaves that want a
    # gradient) are read by the rerun as they are, and its backward accumulates their gradients
    # (and fires their hooks) once; were they inputs, the node would also hand them an empty
    # gradient. Each call costs a pass over the values and one Function.apply of the activations
    # alone: a layer reads a dozen parameters and one or two activations, and this runs once per
    # layer and micro-batch, where a GPU kernel takes microseconds.
    rerun = _Rerun(forward, autocast, list(values))
    passed = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and not (v.requires_grad and v.is_leaf):
            rerun.at.append(i)
            rerun.values[i] = None  # held by save_for_backward, not twice
            passed.append(v)
    if not any(v.requires_grad for v in passed):  # the outputs must want a gradient when only
        passed.append(_ANCHOR)  # parameters do (a region reading token ids)
    out = _Recompute.apply(rerun, *passed)
    if rerun.spec is None:
        return out
    tensors = iter(out)
    return pytree.tree_unflatten([next(tensors) if v is _TENSOR else v for v in rerun.leaves], rerun.spec)


class _Rerun:
    """What a recomputed region's autograd node needs to rerun it: the forward, its autocast, the
    values it was called with (the activations' places ``at`` left empty: the node saves them), and
    its output's structure where that is not a tuple of tensors (``spec``, ``leaves``)."""

    __slots__ = ("forward", "autocast", "values", "at", "spec", "leaves")

    def __init__(self, forward: Callable[..., Any], autocast: Callable[[], Any], values: list[Any]) -> None:
        self.forward, self.autocast, self.values = forward, autocast, values
        self.at: list[int] = []
        self.spec: pytree.TreeSpec | None = None
        self.leaves: list[Any] = []


_TENSOR = object()  # a tensor leaf's place in ``_Rerun.leaves``
_ANCHOR = torch.empty(0, requires_grad=True)  # makes the node's outputs want a gradient


def _tensors_out(rerun: _Rerun, out: Any) -> tuple[torch.Tensor, ...]:
    """``out``'s tensors; where ``out`` is not a tuple of tensors (a program's usual output), its
    structure is kept on ``rerun`` to be rebuilt around the node's outputs."""
    if type(out) is tuple and all(isinstance(v, torch.Tensor) for v in out):
        return out
    leaves, rerun.spec = pytree.tree_flatten(out)
    rerun.leaves = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
    return tuple(v for v in leaves if isinstance(v, torch.Tensor))


class _Recompute(torch.autograd.Function):
    """One autograd node for a recomputed region: forward without autograd, keeping its
    activation inputs; backward reruns it with autograd and back-propagates the outputs' gradients
    through it, returning those of the activations (detached for the rerun) and accumulating the
    parameters'."""

    @staticmethod
    def forward(ctx: Any, rerun: _Rerun, *passed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rerun = rerun
        ctx.save_for_backward(*passed)
        values = list(rerun.values)
        for i, v in zip(rerun.at, passed):
            values[i] = v
        return _tensors_out(rerun, rerun.forward(*values))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        rerun: _Rerun = ctx.rerun
        values = list(rerun.values)
        saved = ctx.saved_tensors
        detached = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        for i, t in zip(rerun.at, detached):
            values[i] = t
        with torch.enable_grad(), rerun.autocast():
            out = rerun.forward(*values)
        outs = out if rerun.spec is None else [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        roots, root_grads = [], []
        for o, g in zip(outs, grads):
            if g is not None and o.requires_grad:
                roots.append(o)
                root_grads.append(g)
        if roots:
            # the engine itself: torch.autograd.backward's checks of each root's gradient (its
            # shape, dtype, device) cost more than the engine's call in a small layer, and the
            # node's own outputs and their gradients already agree
            Variable._execution_engine.run_backward(tuple(roots), tuple(root_grads), False, False, (), True, True)
        return (None, *(t.grad for t in detached))


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
