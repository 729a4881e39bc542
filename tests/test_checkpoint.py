"""Sharded checkpoints with torch.distributed.checkpoint (runtime/state/sharded.py), on real gloo
processes: exact resume bit for bit on DP, ZeRO-1/3, TP, PP (tied embedding), dp x tp with ZeRO-3
and tp x pp; resharding across plans; torch's dcp_to_torch_save loads into the plain model."""

from __future__ import annotations

import pytest

import checkpoint_worker
from harness import launch
from partita.runtime.state.sharded import flat_range_pieces
from partita.core.options import Options


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume-2", "resume-reshard-4"])
def test_checkpoints_resume_exactly_and_reshard(name, tmp_path):
    world, checks = checkpoint_worker.LAUNCHES[name]
    launch(world, checks, str(tmp_path))


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

    from dp_worker import OPTIMIZERS, gpt_loss
    from partita.runtime.engine import ParallelModel

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
