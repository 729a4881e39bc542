"""Pipeline-parallel runtime on real gloo processes, against a single-process reference: the runs on
several processes (tests/unit/test_runtime_pp.py has the single-process checks)."""

from __future__ import annotations

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_runtime_pp import ATOL, CASES, RTOL
from tests.workers import pp_worker


@pytest.mark.parametrize("name", list(pp_worker.LAUNCHES))
def test_pipeline_parallel_matches_single_process(name, tmp_path):
    world, checks = pp_worker.LAUNCHES[name]
    check(name, launch(world, checks, str(tmp_path)))


def check(name: str, per_rank: list) -> None:
    """Each rank's results of launch ``name`` (the 8-rank one's: tests/integration/test_mesh8.py)."""
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']}" + (f" stage {r['stage']}" if "stage" in r else "")
            if "inference" in r["case"]:
                assert not beyond(r["output"], rtol=RTOL, atol=ATOL), f"{what}: inference output"
                continue
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(r["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
            assert r["held"] and not r["not_the_models"], (what, "holds", r["held"], r["not_the_models"])
            # every parameter is held by some stage, and nothing else
            assert not r["held_by_none"] and not r["held_by_some"], (what, r["held_by_none"], r["held_by_some"])
            for step, sends in enumerate(r["p2p_sends"]):
                assert sends == r["expected_sends"], f"{what} step {step}: p2p sends, and the tensors crossing cuts"
            if "trace" in r:  # every micro-batch's F and B on every rank, in the schedule's order
                trace = r["trace"]
                assert trace["spans"] == trace["expected_spans"], (what, trace["spans"], trace["expected_spans"])
                assert trace["fingerprint"] == trace["plan_fingerprint"], what
                for stage in trace["orders"]:
                    assert stage["order"] == stage["schedule"], (what, stage)
        assert sum("trace" in r for r in results) == {"pp4-dp2xpp2-tp2xpp2": 2, "pp2": 1}.get(name, 0)
