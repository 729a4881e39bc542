"""Gradient buckets: the one rule that groups gradients into all-reduce (or ZeRO) calls.

The planner prices the buckets it packs from parameter sizes
(passes/dp/buckets.py ``gradient_buckets``) and the runtime all-reduces the
buckets it packs from the live parameters (runtime/dp/averaging.py), both with
``pack_buckets``, so the plan lists the calls the runtime makes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def pack_buckets(sizes: Sequence[int], cap_bytes: int = DEFAULT_BUCKET_BYTES,
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
