"""The data-parallel axis's planner half: how gradients are grouped into collectives.

The data-parallel degree is chosen jointly with the other axes (passes/search.py:
passes/tp/mesh.py at pp = 1, passes/pipeline/stages.py at pp > 1, with
ZeRO as passes/dp/zero.py says); what is data parallelism's own is the gradient
buckets those searches price and the plan lists: ``gradient_buckets`` packs them
by core/buckets.py's rule, the one the runtime all-reduces by
(runtime/dp/averaging.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.core.buckets import DEFAULT_BUCKET_BYTES, WHOLE_UNITS, pack_buckets


def gradient_buckets(numels: Sequence[int], elem_bytes: int, cap_bytes: int = DEFAULT_BUCKET_BYTES,
                     units: Sequence[str] | None = None) -> list[int]:
    """Bytes of each gradient bucket of parameters of ``numels`` elements (registration order),
    packed by core/buckets.py's ``pack_buckets``, the runtime's rule; with ``units`` (ZeRO-3's unit
    of each parameter, core/buckets.py ``unit_of``) one bucket per run of a unit, whatever its size."""
    sizes = [n * elem_bytes for n in numels]
    packed = pack_buckets(sizes, WHOLE_UNITS, units) if units is not None else pack_buckets(sizes, cap_bytes)
    return [sum(sizes[i] for i in b) for b in packed]
