"""Sharded checkpoints with torch.distributed.checkpoint (runtime/state/sharded.py), on real gloo
processes: the runs on several processes (tests/unit/test_checkpoint.py has the single-process
checks)."""

from __future__ import annotations

import pytest

from partita.core.options import Options
from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_checkpoint import ATOL, CASES, RTOL
from tests.workers import checkpoint_worker
from tests.workers.checkpoint_worker import MORE, K


@pytest.mark.parametrize("name", ["resume-2", "resume-reshard-4"])
def test_checkpoints_resume_exactly_and_reshard(name, tmp_path):
    world, checks = checkpoint_worker.LAUNCHES[name]
    for rank, results in enumerate(launch(world, checks, str(tmp_path))):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']}"
            kind = r["case"].split("/")[0]
            if kind == "resume":  # bit for bit: the same losses, the same state afterwards
                assert r["saved_at"] == K and r["loaded_at"] == K and r["ended_at"] == K + MORE, what
                assert r["extra"] == {"data_position": K}, (what, r["extra"])
                assert r["losses"] == r["first_losses"], what
                assert not beyond(r["state"], rtol=0, atol=0), f"{what}: state after resuming"
            elif kind == "reshard":  # from the checkpoint on, as one process goes on
                assert r["global_batches"][0] == r["global_batches"][1], (what, r["global_batches"])
                assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=RTOL, atol=ATOL), f"{what}: losses"
                assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters"
            elif kind == "torch_save":  # rank 0 reads the file back
                if rank == 0:
                    assert r["strict_load_refused"] is None, (what, r["strict_load_refused"])
                    assert not beyond(r["params"], rtol=0, atol=0), f"{what}: parameters loaded"
            else:  # every parameter as saved
                assert not beyond(r["state"], rtol=0, atol=0), f"{what}: state loaded"
def test_a_four_rank_checkpoint_loads_into_one_process(tmp_path):
    """dp2 x tp2 with ZeRO-3 on 4 ranks, loaded by a single process (no process group): every
    parameter and Adam moment equals what torch's dcp_to_torch_save reads back."""
    import copy

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from partita.runtime.engine import ParallelModel
    from tests.workers.dp_worker import OPTIMIZERS, gpt_loss

    launch(4, checkpoint_worker.save_4, str(tmp_path))
    path = tmp_path / "save-gpt"
    reference, plan = checkpoint_worker._plan("gpt")
    model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=gpt_loss, optimizer=OPTIMIZERS["adamw"]))
    model.load_checkpoint(path)
    dcp_to_torch_save(str(path), str(tmp_path / "plain.pt"))
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert model.step == checkpoint_worker.K
    for name, p in model.module.named_parameters():
        assert torch.equal(p.detach(), plain["model"][name]), name
        state = model.optimizer.state[p]
        assert torch.equal(state["exp_avg"], plain["optim"][f"{name}/exp_avg"]), name
