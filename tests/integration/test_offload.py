"""Optimizer offload (core/optimizers.py OFFLOAD): the runs on several processes
(tests/unit/test_offload.py has the single-process checks)."""

from __future__ import annotations

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_offload import ATOL, RTOL
from tests.workers import offload_worker


def test_offloaded_optimizer_matches_one_process_and_the_device_run(tmp_path):
    world, checks = offload_worker.LAUNCHES["2ranks"]
    for rank, results in enumerate(launch(world, checks, str(tmp_path))):
        assert [r["case"] for r in results] == ["gpt/dp=2/pp=1/zero0/m=2", "gpt/dp=2/pp=1/zero1/m=2",
                                                "gpt/dp=2/pp=1/zero2/m=2", "gpt/dp=1/pp=2/zero0/m=4"]
        for r in results:
            what = f"rank {rank} {r['case']}"
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
            assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the last steps"
            assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
            # fp32: the host's step is the device's arithmetic on a copy of the parameters
            assert r["losses"] == r["plain_losses"] and r["unlike_plain"] == 0.0, what
            assert r["offload"] and r["masters"] and r["masters_apart"], what
            assert r["master_devices"] == ["cpu"] and r["state_devices"] == ["cpu"] and r["state_tensors"], what
