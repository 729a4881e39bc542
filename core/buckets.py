"""Gradient buckets: the one rule that groups gradients into all-reduce (or ZeRO) calls.

The planner prices the buckets it packs from parameter sizes
(passes/dp/buckets.py ``gradient_buckets``) and the runtime all-reduces the
buckets it packs from the live parameters (runtime/dp/averaging.py), both with
``pack_buckets``, so the plan lists the calls the runtime makes.

ZeRO-3 gathers and frees parameters a unit at a time, and its units follow the model's
repeated layers, as FSDP2 wraps blocks (``Training.zero_units``): each layer's parameters are
one bucket (``unit_of``, whatever its size), the parameters outside the layers the buckets
their runs make.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb
WHOLE_UNITS = math.inf  # the cap of ZeRO-3's unit buckets: a unit is one bucket, whatever its size


def unit_of(name: str, units: Sequence[str] | frozenset[str]) -> str:
    """The ZeRO-3 unit of parameter (or module) ``name``: the longest of ``units`` (module paths,
    one repeated layer each) it lies in, or "" (the root: what lies outside every layer)."""
    layers = units if isinstance(units, frozenset) else _as_set(tuple(units))
    if name in layers:
        return name
    best, i = "", name.find(".")
    while i != -1:  # the module paths that hold ``name``, shortest first: the last found is the longest
        if name[:i] in layers:
            best = name[:i]
        i = name.find(".", i + 1)
    return best


@functools.lru_cache(maxsize=64)
def _as_set(units: tuple[str, ...]) -> frozenset[str]:
    return frozenset(units)


def pack_buckets(sizes: Sequence[int], cap_bytes: float = DEFAULT_BUCKET_BYTES,
                 kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Indices into ``sizes`` (bytes per parameter, registration order) of each bucket, in the
    order the buckets are reduced.

    Parameters are walked in REVERSE (roughly the order backward produces their
    gradients) and appended to the open bucket; a bucket closes as soon as its bytes
    reach ``cap_bytes`` (so it may exceed the cap by its last parameter, and one
    parameter larger than the cap is a bucket of its own). With ``kinds`` (a dtype
    per parameter), a parameter of another kind than the open bucket's closes that
    bucket first. The last, partial bucket closes at the end."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(sizes))):
        if current and kinds is not None and kinds[i] != kinds[current[0]]:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += sizes[i]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
