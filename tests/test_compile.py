"""``compile=True``: each rank's program through ``torch.compile`` (inductor's C++ backend on this CPU)
trains like one process, on the planner's tp=2 plan over two gloo processes (whose reshards break the
graph: one line says so, once) and on a one-process plan that recomputes every layer (whole: no line).
compile_worker.py measures, the test asserts."""

from __future__ import annotations

import pytest

from tests import compile_worker
from tests.harness import beyond, launch, numbers_beyond

# fp32; inductor fuses and reorders the sums of the same numbers
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.slow
def test_compiled_programs_train_as_one_process():
    ranks = launch(2, compile_worker.run, timeout_s=900)
    for rank, results in enumerate(ranks):
        for case, r in results.items():
            what = f"rank {rank} {case} ({r['mesh']})"
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), (what, r["losses"])
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), what
    assert "recompute" in ranks[0] and "recompute" not in ranks[1]
    # the tp plan's collectives break the graph: reported in one line, on rank 0 only
    assert len(ranks[0]["tp2"]["printed"]) == 1 and "breaks the graph" in ranks[0]["tp2"]["printed"][0]
    assert ranks[1]["tp2"]["printed"] == []
    assert ranks[0]["recompute"]["printed"] == []  # taken whole
