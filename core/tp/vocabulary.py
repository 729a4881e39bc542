"""The words the tensor-parallel solver speaks: placements, strategies, and the reshard between them.

A *placement* says how a tensor lies over a tensor-parallel group of t ranks
(core/placement.py parses them):

- ``"replicate"``: every rank holds the whole tensor;
- ``"shard(D)"``: rank r holds the r-th of t equal slices of dim D (D >= 0);
- ``"partial"``: every rank holds a tensor of the full shape, and their sum is the value.

Gradients use the same words for the gradient tensor. The *gradient
convention* of a forward placement is the gradient placement its producer
expects to receive: replicate -> replicate (the full gradient on every rank),
shard(D) -> shard(D), partial -> replicate (d sum / d part = identity).

A ``Strategy`` of a node says which placement each tensor input must arrive
in, which placement each output comes out in, and which gradient placement
the op's local backward produces for each input. The edge from a producer
to a consumer then costs two reshards, both from ``reshard_kind``:

    forward:  producer.out[i]                  -> consumer.ins[j]
    backward: consumer.grads[j]                -> grad_convention(producer.out[i])

(Megatron's f and g operators are the two cases of this rule: a replicated
activation entering a column-parallel linear has grads ``partial``, so its
edge all-reduces in backward; a row-parallel linear's ``partial`` output
entering a replicated op all-reduces in forward.)

The op rules (core/tp/rules.py) build strategies in these words and
core/tp/strategies.py offers them per graph node; both import this module,
which imports neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from partita.core.placement import NONE, PARTIAL, REPLICATE, shard_dim

# The names a strategy goes by (a plan's ``nodes[].strategy``): these words, ``shard(D)`` for an
# op split along its dim D, and ``partial`` / ``partial(J)`` for one whose output is partial (the
# J-th operand partial). ``Strategy`` refuses any other name, and a plan is checked against them.
STRATEGY_WORDS = ("replicate", "col", "row", "vocab", "dim", "heads")
_STRATEGY_NAME = re.compile(rf"^({'|'.join(STRATEGY_WORDS)}|shard\(\d+\)|partial(\(\d+\))?)$")


def is_strategy_name(name: str) -> bool:
    """Whether ``name`` is one a strategy can have (``STRATEGY_WORDS``)."""
    return bool(_STRATEGY_NAME.match(name))


def grad_convention(placement: str) -> str:
    """The gradient placement a producer of ``placement`` expects back."""
    if placement == PARTIAL:
        return REPLICATE
    return placement


def reshard_kind(src: str, dst: str) -> str:
    """The collective that turns ``src`` into ``dst`` on a TP group.

    "none" (same placement), "slice" (replicate -> shard: local, no traffic),
    "all_gather" (shard -> replicate), "all_reduce" (partial -> replicate),
    "reduce_scatter" (partial -> shard), "all_to_all" (shard(a) -> shard(b)).
    "invalid" for conversions with no collective (replicate -> partial: a
    strategy never asks for it; ``NONE`` on either side is "none").
    """
    if src == dst or NONE in (src, dst):
        return "none"
    s, d = shard_dim(src), shard_dim(dst)
    if src == REPLICATE:
        return "slice" if d is not None else "invalid"
    if src == PARTIAL:
        return "all_reduce" if dst == REPLICATE else "reduce_scatter"
    # src is a shard
    if dst == REPLICATE:
        return "all_gather"
    if d is not None and s != d:
        return "all_to_all"
    return "invalid"


@dataclass(frozen=True)
class Strategy:
    """One way to run a node over a TP group of size t.

    ``ins``/``grads`` follow the node's tensor arguments as the DiGraph node
    attribute ``inputs`` lists them (argument order, repeats kept); ``out`` its
    tensor outputs (one entry for a single tensor, one per item of a tuple).
    ``compute_fraction`` is local FLOPs / the node's FLOPs (1/t when split,
    1 when replicated); ``memory_fraction`` the share of the node's output and
    saved bytes one rank holds; ``internal`` the collectives the op itself runs
    per forward+backward, as (kind, bytes) (e.g. a vocabulary-parallel
    cross-entropy all-reduces its max, sum of exponentials and target logit).
    """

    name: str
    out: tuple[str, ...]
    ins: tuple[str, ...]
    grads: tuple[str, ...]
    compute_fraction: float = 1.0
    memory_fraction: float = 1.0
    internal: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not is_strategy_name(self.name):
            raise ValueError(f"strategy name {self.name!r} is not in the vocabulary (STRATEGY_WORDS)")
        if len(self.ins) != len(self.grads):
            raise ValueError(f"strategy {self.name}: {len(self.ins)} inputs but {len(self.grads)} grads")


def replicated(n_in: int, n_out: int, grads: tuple[str, ...] | None = None) -> Strategy:
    """Every rank runs the whole op on whole tensors: the strategy every node has."""
    return Strategy("replicate", (REPLICATE,) * n_out, (REPLICATE,) * n_in,
                    grads if grads is not None else (REPLICATE,) * n_in)
