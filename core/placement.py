"""Placements: how a tensor lies over a tensor-parallel group, and the one parser of their words.

The plan file keeps placements as strings (``"replicate"``, ``"shard(D)"``,
``"partial"``, and ``"none"`` for a gradient that does not flow); everything
that reads one goes through ``Placement.parse`` or the helpers below, so the
planner, the plan's readers and the runtime agree on what a word means.

- ``replicate``: every rank holds the whole tensor;
- ``shard(D)``: rank r holds the r-th of t equal slices of dim D (D >= 0);
- ``partial``: every rank holds a tensor of the full shape, and their sum is the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

REPLICATE = "replicate"
PARTIAL = "partial"
NONE = "none"  # no gradient flows (integer tensors, constants)

_SHARD = re.compile(r"^shard\((\d+)\)$")


@dataclass(frozen=True)
class Placement:
    """A parsed placement: ``kind`` is "replicate", "shard", "partial" or "none"; ``dim`` the
    sharded dim (None unless a shard)."""

    kind: str
    dim: int | None = None

    @classmethod
    def parse(cls, text: str) -> Placement:
        """The placement a plan string names; ``ValueError`` for any other word."""
        m = _SHARD.match(text)
        if m:
            return cls("shard", int(m.group(1)))
        if text in (REPLICATE, PARTIAL, NONE):
            return cls(text)
        raise ValueError(f"{text!r} is not a placement: expected replicate, partial, none or shard(D)")

    def __str__(self) -> str:
        return shard(self.dim) if self.kind == "shard" and self.dim is not None else self.kind


def shard(dim: int) -> str:
    """The placement word for a shard of ``dim``."""
    if dim < 0:
        raise ValueError(f"shard dim {dim} must be non-negative (normalise with the tensor's rank)")
    return f"shard({dim})"


def shard_dim(placement: str) -> int | None:
    """The dim of a ``shard(D)`` placement, else None."""
    m = _SHARD.match(placement)
    return int(m.group(1)) if m else None


def is_shard(placement: str) -> bool:
    """Whether ``placement`` splits the tensor over the group (each rank holds 1/t of it)."""
    return shard_dim(placement) is not None
