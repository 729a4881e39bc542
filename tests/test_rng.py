"""Random state under tensor parallelism (runtime/rng.py) on real gloo processes: replicated
parameters stay bit-identical whatever each rank seeds (tp2, tp2 x dp2, tp2 x pp2, BERT with dropout),
the replica check names a divergence, recomputation draws the same masks; and the seeds' rules."""

from __future__ import annotations

import pytest

import rng_worker
from harness import launch
from partita.runtime.rng import is_random, op_seed


@pytest.mark.slow
@pytest.mark.parametrize("name", list(rng_worker.LAUNCHES))
def test_replicated_parameters_never_drift(name, tmp_path):
    world, checks = rng_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    for results in per_rank:
        for r in results:
            assert r["drift_without"].startswith("parameter "), r


def test_which_ops_draw_and_how_their_seeds_differ():
    import torch

    assert is_random(torch.ops.aten.native_dropout.default) and is_random(torch.ops.aten.randn_like.default)
    assert not is_random(torch.ops.aten.linear.default)
    base = op_seed(7, "dropout_3", 2, 1, 0, None)
    assert base == op_seed(7, "dropout_3", 2, 1, 0, None)  # reproducible: recomputation draws it again
    others = [op_seed(8, "dropout_3", 2, 1, 0, None), op_seed(7, "dropout_4", 2, 1, 0, None),
              op_seed(7, "dropout_3", 3, 1, 0, None), op_seed(7, "dropout_3", 2, 0, 0, None),
              op_seed(7, "dropout_3", 2, 1, 1, None), op_seed(7, "dropout_3", 2, 1, 0, 0)]
    assert base not in others and len(set(others)) == len(others)  # run, node, step, micro-batch, dp, tp shard
