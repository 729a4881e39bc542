"""Random state under tensor parallelism (runtime/rng.py) on real gloo processes: replicated
parameters stay bit-identical whatever each rank seeds (tp2, tp2 x dp2, tp2 x pp2, BERT with dropout),
the replica check names a divergence, recomputation draws the same masks; and the seeds' rules."""

from __future__ import annotations

from partita.runtime.rng import is_random, op_seed

CASES = {"tp2": ["rng/{'tp': 2}"], "tp2xdp2-tp2xpp2": ["rng/{'tp': 2, 'dp': 2}", "rng/{'tp': 2, 'pp': 2}"]}


def test_which_ops_draw_and_how_their_seeds_differ():
    import torch

    assert is_random(torch.ops.aten.native_dropout.default) and is_random(torch.ops.aten.randn_like.default)
    assert not is_random(torch.ops.aten.linear.default)
    # attention draws only for its dropout: at p = 0 it needs no seed (nor does a dropout of 0)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    assert is_random(sdpa) and is_random(sdpa, [1, 2, 3, None, 0.1]) and is_random(sdpa, [1, 2, 3], {"dropout_p": 0.1})
    assert not is_random(sdpa, [1, 2, 3, None, 0.0, True]) and not is_random(sdpa, [1, 2, 3], {"is_causal": True})
    assert not is_random(torch.ops.aten.native_dropout.default, [1, 0.0, True])
    base = op_seed(7, "dropout_3", 2, 1, 0, None)
    assert base == op_seed(7, "dropout_3", 2, 1, 0, None)  # reproducible: recomputation draws it again
    others = [op_seed(8, "dropout_3", 2, 1, 0, None), op_seed(7, "dropout_4", 2, 1, 0, None),
              op_seed(7, "dropout_3", 3, 1, 0, None), op_seed(7, "dropout_3", 2, 0, 0, None),
              op_seed(7, "dropout_3", 2, 1, 1, None), op_seed(7, "dropout_3", 2, 1, 0, 0)]
    assert base not in others and len(set(others)) == len(others)  # run, node, step, micro-batch, dp, tp shard
