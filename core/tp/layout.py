"""From a choice of strategy per node to the plan's tensor-parallel node decisions.

The mechanism half of tensor parallelism (the policy, which strategy each node
takes, is the solver's or a user's): ``layout_decisions`` turns a node ->
``Strategy`` map into one ``NodeDecision`` per graph node, with each input's
forward and backward reshard (see core/tp/strategies.py for the rule), and
``tp_collectives`` lists the collectives one rank then runs per micro-batch.
runtime/tp/module.py executes exactly these decisions, and its counted
collectives equal ``tp_collectives``: the two must change together.

Reads the DiGraph attributes ``op``, ``kind``, ``module``, ``inputs``, ``shapes``,
``dtypes``, ``args`` and, when present, ``layer`` and ``flops_fwd``. Writes nothing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

import networkx as nx

from partita.core.model.ops import base_op
from partita.core.placement import NONE
from partita.core.plans.plan import InputLayout, NodeDecision
from partita.core.precision import dtype_bytes, is_floating
from partita.core.tp.strategies import input_index, node_strategies
from partita.core.tp.vocabulary import Strategy, grad_convention, reshard_kind

# collectives with traffic; "none" and "slice" are local
_LOCAL = ("none", "slice")
# Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2) a linear layer whose
# activation input is all-gathered keeps its own slice for backward and gathers it again there,
# instead of keeping the gathered tensor: (t-1)/t of that input's bytes not held, one all-gather
# more per backward. The ops that do (runtime/tp/local_ops.py ``RegatheredLinear``):
REGATHERED_OPS = frozenset({"linear"})
REGATHER_PURPOSE = "backward regather (sequence parallel)"


def may_regather(op: str, j: int) -> bool:
    """Whether input ``j`` of a node calling ``op`` ("aten.linear.default" or "linear") is one a
    sequence-parallel plan may regather (its activation input)."""
    return j == 0 and base_op(op) in REGATHERED_OPS


def regathers(op: str, j: int, fwd: str, sequence_parallel: bool, grads: Sequence[str]) -> bool:
    """Whether input ``j`` of a node calling ``op``, reached by the forward reshard ``fwd``, is kept
    as its slice and gathered again in backward. ``grads``: the gradient placements of the node's
    inputs (a strategy's ``grads``, a decision's ``ins[].grad``); only where the weight (input 1)
    gets a gradient does backward read the input at all."""
    return (sequence_parallel and fwd == "all_gather" and may_regather(op, j)
            and len(grads) > 1 and grads[1] != NONE)


def _elem_size(dtype: str, elem_bytes: int | None) -> int:
    """Bytes of one element of ``dtype``: ``elem_bytes`` for a floating one when given (the precision's)."""
    if elem_bytes is not None and is_floating(dtype):
        return elem_bytes
    return dtype_bytes(dtype)


def tensor_bytes(G: nx.DiGraph, node: str, index: int, elem_bytes: int | None = None) -> int:
    """Bytes of the node's ``index``-th tensor output (whole, not one rank's share)."""
    a = G.nodes[node]
    return math.prod(a["shapes"][index]) * _elem_size(a["dtypes"][index], elem_bytes)


def layout_decisions(
    G: nx.DiGraph, t: int, choice: Mapping[str, Strategy], *, elem_bytes: int | None = None,
) -> tuple[NodeDecision, ...]:
    """One ``NodeDecision`` per node of ``G`` in graph (fx) order for a TP group of ``t``.

    A node missing from ``choice`` takes its replicated strategy. Each input's
    ``have`` is its producer's output placement, ``need``/``grad`` the node's
    strategy's, ``grad_need`` the gradient convention of ``have`` (``"none"``
    when no gradient flows), ``fwd``/``bwd`` the reshards between them and
    ``bytes`` the whole tensor's (floating tensors at ``elem_bytes`` per element
    when given). ``internal`` lists the op's own collectives as "KIND:BYTES"
    (payloads at fp32, what the runtime reduces in). Raises ``ValueError``
    naming the node when a reshard has no collective.
    """
    def chosen(n: str) -> Strategy:
        s = choice.get(n)
        return s if s is not None else node_strategies(G, n, t)[0]

    decisions = []
    for name, a in G.nodes(data=True):
        s = chosen(name)
        if len(s.ins) != len(a["inputs"]):
            raise ValueError(f"node {name} ({a['op']}): strategy {s.name!r} has {len(s.ins)} inputs, "
                             f"the node {len(a['inputs'])}")
        ins = []
        for j, src in enumerate(a["inputs"]):
            idx = input_index(G, name, j)
            have = chosen(src).out[idx]
            need, grad = s.ins[j], s.grads[j]
            grad_need = NONE if grad == NONE else grad_convention(have)
            fwd, bwd = reshard_kind(have, need), reshard_kind(grad, grad_need)
            if "invalid" in (fwd, bwd):
                where = f" at {a['source']}" if a.get("source") else ""
                edge = f"forward {have} -> {need}" if fwd == "invalid" else f"backward gradient {grad} -> {grad_need}"
                raise ValueError(
                    f"node {name} ({a['op']}, module {a.get('module') or '<root>'}{where}), strategy "
                    f"{s.name!r}: input {j} from {src} needs {edge}, which no collective performs"
                )
            ins.append(InputLayout(src=src, index=idx, have=have, need=need, grad=grad, grad_need=grad_need,
                                   fwd=fwd, bwd=bwd, bytes=tensor_bytes(G, src, idx, elem_bytes)))
        decisions.append(NodeDecision(
            name=name, op=a["op"], module=a.get("module", ""), strategy=s.name, out=tuple(s.out),
            ins=tuple(ins), internal=tuple(f"{k}:{b}" for k, b in s.internal),
            layer=a.get("layer", ""), flops_fwd=int(a.get("flops_fwd", 0)),
        ))
    return tuple(decisions)


def internal_purpose(op: str, strategy: str) -> str:
    """What an op's own collectives are for, as ``tp_collectives`` names them."""
    short = op.split(".")[1] if op.startswith("aten.") else op
    what = {"cross_entropy_loss": "cross-entropy", "_softmax": "softmax", "softmax": "softmax",
            "_log_softmax": "log-softmax", "log_softmax": "log-softmax"}.get(short, short)
    kind = {"vocab": "vocab-parallel", "shard(0)": "batch-parallel"}.get(strategy, strategy)
    return f"op-internal ({kind} {what})"


def tp_collectives(decisions: tuple[NodeDecision, ...] | list[NodeDecision], *,
                   sequence_parallel: bool = False) -> list[tuple[str, int, int, str]]:
    """(kind, bytes, calls, purpose) of the collectives one rank runs per micro-batch, sorted.

    Forward reshards ("forward reshard"), backward reshards ("backward reshard")
    other than none/slice, the ops' internal collectives, and under ``sequence_parallel`` the
    backward all-gather of each regathered input (``regathers``); ``bytes`` is the whole
    tensor's for reshards and the reduced buffer's for internal ones.
    """
    calls: Counter = Counter()
    for d in decisions:
        for j, lay in enumerate(d.ins):
            if lay.fwd not in _LOCAL:
                calls[(lay.fwd, lay.bytes, "forward reshard")] += 1
            if lay.bwd not in _LOCAL:
                calls[(lay.bwd, lay.bytes, "backward reshard")] += 1
            if regathers(d.op, j, lay.fwd, sequence_parallel, [x.grad for x in d.ins]):
                calls[(lay.fwd, lay.bytes, REGATHER_PURPOSE)] += 1
        for entry in d.internal:
            kind, _, nbytes = entry.partition(":")
            calls[(kind, int(nbytes), internal_purpose(d.op, d.strategy))] += 1
    return sorted((k, b, n, p) for (k, b, p), n in calls.items())


# Internal collectives an op runs in its backward, the last of its ``internal`` entries
# (runtime/tp/module.py: a vocabulary-parallel (log-)softmax all-reduces max and sum in
# forward and one sum in backward; the vocabulary cross-entropy runs all three in forward).
_BACKWARD_INTERNAL = {(op, "vocab"): 1 for op in ("softmax", "_softmax", "log_softmax", "_log_softmax")}


def forward_collectives(decisions: tuple[NodeDecision, ...] | list[NodeDecision], *,
                        why: str = "") -> list[tuple[str, int, int, str]]:
    """(kind, bytes, calls, purpose) of the forward alone per micro-batch: the forward reshards and
    the forward part of the ops' internal collectives (an inference step; ``why`` is added to
    each purpose)."""
    calls: Counter = Counter()
    for d in decisions:
        for lay in d.ins:
            if lay.fwd not in _LOCAL:
                calls[(lay.fwd, lay.bytes, f"forward reshard{why}")] += 1
        packet = d.op.split(".")[1] if d.op.startswith("aten.") else d.op
        back = _BACKWARD_INTERNAL.get((packet, d.strategy), 0)
        for entry in d.internal[:len(d.internal) - back]:
            kind, _, nbytes = entry.partition(":")
            calls[(kind, int(nbytes), f"{internal_purpose(d.op, d.strategy)}{why}")] += 1
    return sorted((k, b, n, p) for (k, b, p), n in calls.items())


def recompute_collectives(decisions: tuple[NodeDecision, ...] | list[NodeDecision]) -> list[tuple[str, int, int, str]]:
    """(kind, bytes, calls, purpose) that recomputing ``decisions`` in backward runs again per
    micro-batch: their forward collectives (``forward_collectives``)."""
    return forward_collectives(decisions, why=", again when the layer is recomputed")

