"""Data-parallel runtime on real gloo processes, against a single-process reference: the runs on
several processes (tests/unit/test_runtime_dp.py has the single-process checks)."""

from __future__ import annotations

import pytest

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_runtime_dp import ATOL, RTOL
from tests.workers import dp_worker
from tests.workers.dp_worker import make_plan


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_single_process(world):
    gb = make_plan(world).training.global_batch
    # what each refusal's message must say
    refusals = {"other world size": (f"{world + 1} processes", f"{world} were launched"),
                "tp without nodes": ("tp=2", "no tensor-parallel node decisions"),
                "global batch": (f"batch size {gb + 2}", f"global_batch is {gb}"),
                "local batch": (f"batch size {gb}", f"dp={world}) is {gb // world}")}
    for rank, r in enumerate(launch(world, dp_worker.checks)):
        # 5 data-parallel cases, then ZeRO-1/2/3 through ParallelModel
        names = [c["case"] for c in r["cases"]]
        assert names == ([f"{m}/{o}/dp={world}" for m in ("mlp", "gpt") for o in ("adamw", "sgd")]
                         + [f"mlp/adamw/dp={world}/local"] + [f"zero{s}/gpt/dp={world}" for s in (1, 2, 3)])
        for c in r["cases"]:
            what = f"rank {rank} {c['case']}"
            assert not numbers_beyond(c["losses"], c["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(c["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last step"
        for c in r["cases"][:5]:
            what = f"rank {rank} {c['case']}"
            assert not beyond(c["grads"], rtol=RTOL, atol=ATOL), f"{what}: first step's gradients"
            for step, calls in enumerate(c["calls"]):
                assert calls == c["planned_calls"], f"{what} step {step}: collectives counted, and the plan's"
            for step, (launched, buckets) in enumerate(c["launched_in_backward"]):
                assert launched == buckets, f"{what} step {step}: {launched} of {buckets} all-reduces overlapped"
        for c in r["cases"][5:]:
            slack = 4 * (world - 1) * c["buckets"] * 3 + 8 * c["buckets"]  # padding + AdamW's step counters
            for part in ("params", "grads", "optimizer"):
                assert abs(c["held"][part] - c["predicted"][part]) <= slack, (
                    f"rank {rank} {c['case']}: {part} held, and the cost model's", c["held"], c["predicted"])
        for what, words in refusals.items():
            message = r["refusals"][what]
            assert message is not None, f"rank {rank}: {what} not refused"
            for w in words:
                assert w in message, (what, w, message)
def test_bf16_gradients_averaged_in_fp32_reach_the_optimizer_unrounded():
    """bf16-mixed DP: the fp32 mean of the ranks' bf16 gradients is what the fp32 masters get
    (equal to the mean worked out from the gathered gradients, bit for bit), not that mean
    rounded to bf16 and converted back; each rank's ``.grad`` keeps its own gradient meanwhile,
    and the kept mean is freed with ``zero_grad``."""
    results = launch(2, dp_worker.bf16_mean_kept)
    for r in results:
        assert r == {"dtype": "torch.float32", "exact": True, "own_grad_kept": True, "rounding_differs": True,
                     "freed": True}, r
