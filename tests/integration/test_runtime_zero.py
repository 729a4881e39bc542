"""ZeRO stages 1-3 (runtime/dp/zero.py) on real gloo processes, against a single-process reference.

Each launch (2 and 4 ranks) runs every case (zero_worker.py measures, the test asserts):
stages 1, 2, 3 x MLP and tiny GPT x AdamW and SGD-momentum, 2 micro-batches, 3
steps, eager forward; stage 3 also through a functional forward that fetches
parameters by name (the fx Interpreter's way); 1 micro-batch per stage for the
plan's per-step traffic; an MLP of odd sizes whose shards need padding. Losses, first-step gradients, final
parameters and the output within fp32 tolerance; model-state bytes held equal to the cost model's plus
padding; bytes sent per step equal to zero_traffic_elements (over padded buckets); reduce-scatters
launched during backward; stage 0 and a gather on stage 1 refused.
"""

from __future__ import annotations

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.workers import zero_worker

# fp32: the shards sum the same numbers as one process, in another order
RTOL, ATOL = 1e-5, 1e-6
MOMENTS = {"adamw": 8, "sgd": 4}  # bytes of optimizer state per element: AdamW's two moments, SGD's momentum


def _case_names(world: int) -> list[str]:
    """The 19 cases of ``zero_worker.checks``, in order."""
    return ([f"zero{s}/{m}/{o}/dp={world}/accum=2" for s in (1, 2, 3) for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
            + [f"zero{s}/mlp/adamw/dp={world}/accum=1" for s in (1, 2, 3)]
            + [f"zero{s}/odd/adamw/dp={world}/accum=2" for s in (1, 2, 3)]
            + [f"zero3/mlp/adamw/dp={world}/accum=2/interpreter"])


def _assert_case(c: dict, n: int, what: str) -> None:
    stage, opt_name, accum = c["stage"], c["optimizer"], c["accum"]
    assert not numbers_beyond(c["losses"], c["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
    assert not beyond(c["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
    assert not beyond(c["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
    assert not beyond(c["output"], rtol=RTOL, atol=ATOL), f"{what}: output after the last step"
    # Every micro-batch's backward launched every bucket's reduce-scatter (overlapped, not after the
    # backward); stage 1 reduces once, in the last micro-batch of the step.
    for i, (launched, buckets) in enumerate(c["launched_in_backward"]):
        last = i % accum == accum - 1
        assert launched == buckets or (stage == 1 and not last), (
            f"{what} micro-batch {i}: {launched} of {buckets} reduce-scatters launched in backward")
    assert c["bucket_bytes"] == c["planner_buckets"], f"{what}: buckets, and the planner's bucket_layout"

    # Model state held after a step, against the cost model (exact with padding counted).
    padded = c["num_params"] + c["padding_elements"]
    step_tensors = 4 * len(c["bucket_bytes"]) if opt_name == "adamw" else 0  # AdamW's fp32 `step` per shard
    held = c["held"]
    assert held == {
        "params": 4 * padded // (n if stage == 3 else 1),
        "grads": 4 * padded // (n if stage >= 2 else 1),
        "optimizer": MOMENTS[opt_name] * padded // n + step_tensors,
    }, (what, held)
    pad_bound = 16 * (n - 1) * len(c["bucket_bytes"]) + step_tensors
    assert 0 <= sum(held.values()) - sum(c["predicted"].values()) <= pad_bound, (what, held, c["predicted"])
    if stage == 3:  # no full copy survives the step
        assert c["gathered_bytes"] == [0] * len(c["bucket_bytes"]), (what, c["gathered_bytes"])
    if stage >= 2:
        assert c["module_grads"] == 0, f"{what}: {c['module_grads']} parameters keep a .grad"

    # Traffic per step, against zero_traffic_elements (over padded buckets).
    expected = c["predicted_traffic_bytes"]
    for t in c["traffic_bytes"]:
        assert abs(t - expected * padded / c["num_params"]) < 1e-6 * expected, (what, t, expected)
    assert c["kinds"] == ["all_gather", "reduce_scatter"], (what, c["kinds"])
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_single_process_and_the_cost_model(world):
    for rank, r in enumerate(launch(world, zero_worker.checks)):
        assert [c["case"] for c in r["cases"]] == _case_names(world)
        for c in r["cases"]:
            _assert_case(c, world, f"rank {rank} {c['case']}")
        stage0, gather = r["refusals"]["stage 0"], r["refusals"]["gather on stage 1"]
        assert stage0 is not None and "stage=0" in stage0, f"stage 0 accepted: {stage0}"
        assert gather is not None and "stage 3" in gather, f"gather accepted on stage 1: {gather}"
