"""ZeRO-3 by units: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_zero_units.py has the one-process checks."""

from __future__ import annotations

from tests.harness import beyond, launch, numbers_beyond
from tests.workers import zero_units_worker


def test_zero3_prefetches_the_next_unit_and_trains_as_one_process():
    for rank, r in enumerate(launch(2, zero_units_worker.run)):
        what = f"rank {rank}"
        assert r["units"] == ["transformer.h.0", "transformer.h.1"], what
        assert r["buckets"] == 4, what  # embeddings, two layers, final norm and head
        # after the first forward learned the order, each forward and backward prefetches the
        # units after its first: 3 each, so 6 a step; the calls are the plan's, prefetched or not
        assert r["prefetched"] == [0, 6, 6], (what, r["prefetched"])
        assert r["calls"] == r["planned_calls"], what
        assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6), what
        assert not beyond(r["params"], rtol=1e-5, atol=1e-6), what
