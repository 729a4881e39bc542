"""Activation recomputation in the runtime on real gloo processes (see recompute_worker.py): the runs
on several processes (tests/unit/test_runtime_recompute.py has the single-process checks)."""

from __future__ import annotations

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_runtime_recompute import ATOL, CASES, RTOL
from tests.workers import recompute_worker


@pytest.mark.parametrize("name", list(recompute_worker.LAUNCHES))
def test_recompute_matches_single_process_and_saves_activations(name, tmp_path):
    world, checks = recompute_worker.LAUNCHES[name]
    for rank, results in enumerate(launch(world, checks, str(tmp_path))):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']} stage {r['stage']}"
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(r["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
            assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
            # recomputed TP layers send in forward again: exactly their forward TP collectives more; an
            # attention core runs head by head, with no TP collective to repeat
            extra = r["extra_calls_per_step"]
            assert bool(extra) == (r["recomputes"] and r["tp"] > 1 and r["mode"] == "full"), (what, extra)
            for step, added in enumerate(r["added_calls"], start=1):
                assert added == extra, (what, f"step {step}: recompute added", added, "expected", extra)
            # One figure per micro-batch, the same for all (the micro-batches have one shape); fewer
            # bytes where the stage recomputes, the same where it does not.
            rc, plain = r["saved_recompute"], r["saved_plain"]
            assert len(rc) == len(plain) == r["micro_batches"] and len(set(rc)) == len(set(plain)) == 1, (
                what, rc, plain)
            if r["recomputes"]:
                assert rc[0] < plain[0], (what, rc[0], plain[0])
            else:
                assert rc[0] == plain[0], (what, rc[0], plain[0])
