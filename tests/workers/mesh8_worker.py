"""The 8-rank mesh's work in one launch (tests/integration/test_mesh8.py asserts it).

dp=2 x tp=2 x pp=2 is the only mesh that needs 8 ranks, and three files had a launch of it each:
pipeline parallelism (pp_worker.py), ZeRO-3 inside it (zero_mesh_worker.py) and the planner's plans
of tied models (tied_script.py). An 8-rank group runs beside the kept ones and ends after its
launch (tests/harness.py), so each launch started 8 processes, imported torch in each and captured
its models afresh; one launch runs the three parts in turn on the same group, each part's checks
unchanged.
"""

from __future__ import annotations

from partita.runtime.distributed import DistContext
from tests.workers import pp_worker, tied_script, zero_mesh_worker

WORLD = 8


def run(ctx: DistContext, out: str, tied_runs: list[str]) -> dict:
    """Each part's results, by part: ``pp`` and ``zero_mesh`` as their launches return them; ``tied``
    writes its files into ``out`` (``tied_script.run``) and returns None."""
    return {"pp": pp_worker.dp2xtp2xpp2(ctx, out), "zero_mesh": zero_mesh_worker.dp2xtp2xpp2(ctx, out),
            "tied": tied_script.run(ctx, out, tied_runs)}
