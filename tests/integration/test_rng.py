"""Random state under tensor parallelism (runtime/rng.py) on real gloo processes: the runs on several
processes (tests/unit/test_rng.py has the single-process checks)."""

from __future__ import annotations

import pytest

from tests.harness import launch
from tests.unit.test_rng import CASES
from tests.workers import rng_worker


@pytest.mark.parametrize("name", list(rng_worker.LAUNCHES))
def test_replicated_parameters_never_drift(name, tmp_path):
    """rng_worker.py measures, the test asserts."""
    world, checks = rng_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']}"
            assert r["dropout_nodes"], f"{what}: the plan has no dropout"
            # with the runtime's random state the replicas agree after every step
            assert r["drift"] is None, (what, r["drift"])
            # an injected divergence is reported, naming the parameter and its group
            assert r["injected"] is not None, f"{what}: an injected divergence was not reported"
            assert r["injected_into"] in r["injected"] and "tp group" in r["injected"], (what, r["injected"])
            # without it the replicas drift, and the check names the parameter
            assert r["drift_without"] is not None, f"{what}: replicas did not drift without the random-state tracker"
            assert r["drift_without"].startswith("parameter "), (what, r["drift_without"])
            # same run seed, same run; a recomputing plan draws the same masks
            assert r["drift_again"] is None and r["again"] == r["losses"], (what, r["again"], r["losses"])
            if "'pp'" not in r["case"]:  # without pipeline stages, recomputed
                assert r["drift_recompute"] is None, (what, r["drift_recompute"])
                assert r["recompute_losses"] == r["losses"], (what, r["recompute_losses"], r["losses"])
