"""Sharded checkpoints with torch.distributed.checkpoint (runtime/state/sharded.py), on real gloo
processes: exact resume bit for bit on DP, ZeRO-1/3, TP, PP (tied embedding), dp x tp with ZeRO-3
and tp x pp; resharding across plans; torch's dcp_to_torch_save loads into the plain model."""

from __future__ import annotations

import pytest

from partita.core.options import Options
from partita.runtime.state.sharded import flat_range_pieces
from tests import checkpoint_worker
from tests.checkpoint_worker import MORE, K
from tests.harness import beyond, launch, numbers_beyond

# Resharding: fp32, but the reduction order differs between the plans, and from one process's
RTOL, ATOL = 1e-4, 2e-5

CASES = {
    "resume-2": ["resume/gpt/{'dp': 2}", "resume/gpt/{'dp': 2, 'zero': 3}", "resume/gpt/{'dp': 2, 'zero': 1}",
                 "resume/gpt/{'dp': 2, 'zero': 1, 'offload': 'optimizer'}", "resume/gpt/{'tp': 2}",
                 "resume/tied-gpt/{'pp': 2}", "torch_save/tied-gpt/{'dp': 2, 'zero': 3}",
                 "pretrained/torch/{'tp': 2}", "pretrained/safetensors/{'pp': 2}",
                 "pretrained/safetensors/{'dp': 2, 'zero': 3}"],
    "resume-reshard-4": ["resume/gpt/{'dp': 2, 'tp': 2, 'zero': 3}", "resume/hf-llama/{'pp': 2, 'tp': 2}",
                         "reshard/gpt/{'dp': 2, 'tp': 2}->{'pp': 2, 'dp': 2, 'zero': 1}",
                         "reshard/gpt/{'dp': 4, 'zero': 3, 'accum': 1}->{'tp': 2, 'pp': 2, 'accum': 4}"],
}


@pytest.mark.slow
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


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 6)])
def test_a_flat_range_is_cut_into_few_contiguous_blocks_that_cover_it(shape):
    import math

    import torch

    n = math.prod(shape)
    whole = torch.arange(n).view(shape)
    for lo in range(n):
        for hi in range(lo, n + 1):
            pieces = flat_range_pieces(shape, lo, hi)
            assert len(pieces) <= 2 * len(shape)
            covered = []
            for off, sizes, start in pieces:
                block = whole[tuple(slice(o, o + s) for o, s in zip(off, sizes))]
                # the block is the flat elements [start, start + its size): contiguous
                assert block.flatten().tolist() == list(range(start, start + block.numel()))
                covered += block.flatten().tolist()
            assert sorted(covered) == list(range(lo, hi))


@pytest.mark.slow
def test_a_four_rank_checkpoint_loads_into_one_process(tmp_path):
    """dp2 x tp2 with ZeRO-3 on 4 ranks, loaded by a single process (no process group): every
    parameter and Adam moment equals what torch's dcp_to_torch_save reads back."""
    import copy

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from partita.runtime.engine import ParallelModel
    from tests.dp_worker import OPTIMIZERS, gpt_loss

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
