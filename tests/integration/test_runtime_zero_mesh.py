"""ZeRO composed with tensor and pipeline parallelism on real gloo processes (see zero_mesh_worker.py).

dp=2 x pp=2 (ZeRO-1 under 1F1B, ZeRO-2 under GPipe, ZeRO-3 under 1F1B, and a
tied-embedding GPT whose shared weight stays out of ZeRO) and dp=2 x tp=2
(ZeRO-3 gathering inside the TP interpreter, GPT and HF Llama), 4 processes
each: losses, gradients and parameters against one process, model state held
against the cost model, and the dp collectives call for call (zero_mesh_worker.py measures, the
test asserts).
"""

from __future__ import annotations

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.workers import zero_mesh_worker

# fp32: the plan sums the same numbers as one process, in another order (dp shards, tp, micro-batches)
RTOL, ATOL = 1e-4, 2e-5

CASES = {
    "dp2xpp2": ["gpt/zero1/dp=2/tp=1/pp=2/1f1b/m=4", "gpt/zero2/dp=2/tp=1/pp=2/gpipe/m=4",
                "gpt/zero3/dp=2/tp=1/pp=2/1f1b/m=4", "tied-gpt/zero3/dp=2/tp=1/pp=2/1f1b/m=4"],
    "dp2xtp2": ["gpt/zero3/dp=2/tp=2/pp=1/none/m=2", "hf-llama/zero3/dp=2/tp=2/pp=1/none/m=2"],
    "dp2xtp2xpp2": ["gpt/zero3/dp=2/tp=2/pp=2/1f1b/m=2"],
}


@pytest.mark.parametrize("name", list(zero_mesh_worker.LAUNCHES))
def test_zero_with_tp_and_pp_matches_single_process(name, tmp_path):
    world, checks = zero_mesh_worker.LAUNCHES[name]
    check(name, launch(world, checks, str(tmp_path)))


def check(name: str, per_rank: list) -> None:
    """Each rank's results of launch ``name`` (the 8-rank one's: tests/integration/test_mesh8.py)."""
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']} stage {r['stage']}"
            assert r["zero_stage"] == r["zero"], f"{what}: the ZeRO program's stage, and the plan's"
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(r["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
            assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
            # the cost model's figure for the rank's parameters, up to the padding (at most dp - 1
            # elements of 16 bytes of state per bucket) and AdamW's fp32 `step` per shard
            step_tensors = 4 * r["buckets"]
            pad_bound = 16 * (r["dp"] - 1) * r["buckets"] + step_tensors
            assert 0 <= sum(r["held"].values()) - sum(r["predicted"]) <= pad_bound, (what, r["held"], r["predicted"])
            if r["zero"] == 3:
                assert r["gathered_bytes"] == [0] * r["buckets"], f"{what}: a gathered bucket survived"
            assert r["bucket_bytes"] == r["planner_buckets"], f"{what}: buckets, and the planner's bucket_layout"
            for step, calls in enumerate(r["dp_calls"], start=1):
                assert calls == r["expected_dp_calls"], f"{what} step {step}: dp collectives, and zero_collectives'"
