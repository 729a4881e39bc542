"""The 8-rank mesh, dp=2 x tp=2 x pp=2, in one launch (tests/workers/mesh8_worker.py): pipeline
parallelism against one process, ZeRO-3 inside it and the planner's plans of tied models. Each part
is checked by its own file's check (test_runtime_pp.py, test_runtime_zero_mesh.py,
test_runtime_tied.py, whose 2- and 4-rank launches run there); the launch is shared because an 8-rank
group starts afresh each time (it is larger than the kept ones), importing torch in 8 processes."""

from __future__ import annotations

from tests.harness import launch
from tests.integration import test_runtime_pp, test_runtime_tied, test_runtime_zero_mesh
from tests.workers import mesh8_worker as worker


def test_the_8_rank_mesh_matches_one_process_for_pipelines_zero_and_tied_models(tmp_path):
    per_rank = launch(worker.WORLD, worker.run, str(tmp_path), test_runtime_tied.runs(tmp_path, dp=2), timeout_s=600)
    # every part is checked, a failing one not hiding the others
    failures = []
    for part, check in [("pp", lambda: test_runtime_pp.check("dp2xtp2xpp2", [r["pp"] for r in per_rank])),
                        ("zero_mesh", lambda: test_runtime_zero_mesh.check("dp2xtp2xpp2",
                                                                           [r["zero_mesh"] for r in per_rank])),
                        ("tied", lambda: test_runtime_tied.check(tmp_path, dp=2))]:
        try:
            check()
        except AssertionError as e:
            failures.append(f"--- {part}: {e}")
    assert not failures, "\n".join(failures)
