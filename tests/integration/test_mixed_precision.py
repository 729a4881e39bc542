"""Mixed precision as planned (issue 10): the runs on several processes
(tests/unit/test_mixed_precision.py has the single-process checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_mixed_precision import (
    CLIP_ATOL,
    CLIP_RTOL,
    LOSS_RTOL,
    NORM_ATOL,
    NORM_RTOL,
    PARAM_ATOL,
    PARAM_RTOL,
)
from tests.workers import mp_worker


def _assert_case(r: dict, rank: int) -> None:
    """A plan's run against one process running the same recipe."""
    what = f"rank {rank} {r['case']} ({r['mesh']})"
    assert r["param_dtypes"] == [r["param_dtype"]], (what, "the parameters as built", r["param_dtypes"])
    assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=LOSS_RTOL, atol=0), (
        what, r["losses"], r["ref_losses"])
    assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
    assert r["final_dtypes"] == [r["param_dtype"]], (what, "the full state", r["final_dtypes"])
    assert not beyond(r["params"], rtol=PARAM_RTOL, atol=PARAM_ATOL), f"{what}: parameters after the steps"
    assert r["moved"] > 4 * PARAM_ATOL, (what, r["moved"])  # the steps move parameters well past the tolerance


def _assert_memory(r: dict, rank: int, world: int) -> None:
    """The model state held equals the plan's prediction, up to ZeRO's padding of its flat buckets
    (at most world - 1 elements of 16 bytes of state per bucket)."""
    held, want = r["held"], r["predicted"]
    pad = 0 if r["stage"] == 0 else 16 * r["buckets"] * (world - 1)
    got, predicted = sum(held.values()), sum(want.values())
    assert predicted <= got <= predicted + pad, (f"rank {rank} {r['case']}", held, want)
    if r["stage"] == 0:
        n = r["numel"]
        assert held == want, (f"rank {rank} {r['case']}", held, want)
        assert want == {"params": 2 * n, "grads": 2 * n, "optimizer": 12 * n}, (f"rank {rank} {r['case']}", want)


def _assert_clipped(r: dict, rank: int) -> None:
    """The norm train_step reports and the clipped steps equal one process's ``clip_grad_norm_``."""
    what = f"rank {rank} {r['case']}"
    assert r["max_grad_norm"] == mp_worker.CLIP, (what, r["max_grad_norm"])
    assert r["norms"] == pytest.approx(r["ref_norms"], rel=NORM_RTOL, abs=NORM_ATOL), (what, r["norms"], r["ref_norms"])
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=NORM_RTOL, abs=NORM_ATOL), (
        what, r["losses"], r["ref_losses"])
    assert min(r["ref_norms"]) > 2 * mp_worker.CLIP, (what, r["ref_norms"])  # every step clipped
    assert not beyond(r["params"], rtol=CLIP_RTOL, atol=CLIP_ATOL), f"{what}: parameters after the steps"


def test_mixed_precision_plans_match_one_process_running_the_same_recipe(tmp_path):
    two = launch(2, mp_worker.compile_and_run_2, str(tmp_path))
    four = launch(4, mp_worker.run_4, str(tmp_path))
    cases = {mp_worker.name(c) for c in mp_worker.CASES_2 + mp_worker.CASES_4}
    for world, per_rank in ((2, two), (4, four)):
        for rank, results in enumerate(per_rank):
            for r in results:
                kind = r["case"].split("/")[0]
                if r["case"] in cases:
                    _assert_case(r, rank)
                    want = "optimizer" if "offload" in r["case"] else "none"
                    assert r["offload"] == want and r["offloaded"] == (want != "none"), (rank, r["case"])
                    assert r["sequence_parallel"] == ("-sp/" in r["case"]), (rank, r["case"])
                elif kind == "memory":
                    _assert_memory(r, rank, world)
                elif kind == "clip":
                    _assert_clipped(r, rank)
                elif kind == "fp16":  # an inf gradient on one rank: every rank skips, the scale halves
                    assert not beyond(r["state_over_the_skip"], rtol=0, atol=0), "a rank stepped on an inf gradient"
                    assert r["skipped"] == 1 and r["scale"][1] == r["scale"][0] / 2, (rank, r)
                    assert r["moved_next"] > 0 and r["skipped_next"] == 1, (rank, r)  # the next step updates
                elif kind == "curve":
                    worst = max(abs(a - b) / b for a, b in zip(r["bf16-mixed"], r["fp32"]))
                    assert worst < 0.01, r  # bf16-mixed's curve within 1% of fp32's
                    assert r["fp32"][-1] < 0.8 * r["fp32"][0], r["fp32"]  # it learns: the curve is not flat
                elif kind == "one-optimizer":  # lr = 0 stops all training, the tied parameter's too
                    assert not r["changed"] and len(set(r["losses"])) == 1, (rank, r["changed"], r["losses"])
                else:
                    raise AssertionError(f"rank {rank}: an unexpected result {r['case']}")
    results = {r["case"]: r for r in two[0] + four[0]}
    assert cases <= set(results)
    assert "curve/bf16-vs-fp32" in results and "fp16/skip" in results and "one-optimizer/lr0" in results
    assert {f"memory/zero{s}" for s in range(4)} <= set(results)
    assert {f"clip/{label}" for label in [*mp_worker.CLIP_PINS_2, *mp_worker.CLIP_PINS_4]} <= set(results)
    Path(tmp_path, "summary.json").write_text(json.dumps(results, indent=1))
