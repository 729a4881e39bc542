"""Random state under tensor parallelism (runtime/rng.py) on real gloo processes: replicated
parameters stay bit-identical whatever each rank seeds (tp2, tp2 x dp2, tp2 x pp2, BERT with dropout),
the replica check names a divergence, recomputation draws the same masks; and the seeds' rules."""

from __future__ import annotations

import pytest

from partita.runtime.rng import is_random, op_seed
from tests import rng_worker
from tests.harness import launch

CASES = {"tp2": ["rng/{'tp': 2}"], "tp2xdp2-tp2xpp2": ["rng/{'tp': 2, 'dp': 2}", "rng/{'tp': 2, 'pp': 2}"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(rng_worker.LAUNCHES))
def test_replicated_parameters_never_drift(name, tmp_path):
    """rng_worker.py measures, the test asserts."""
    world, checks = rng_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    for rank, results in enumerate(per_rank):
        assert [r["case"] for r in results] == CASES[name]
        for r in results:
            what = f"rank {rank} {r['case']}"
            assert r["dropout_nodes"], f"{what}: the plan has no dropout"
            # with the runtime's random state the replicas agree after every step
            assert r["drift"] is None, (what, r["drift"])
            # an injected divergence is reported, naming the parameter and its group
            assert r["injected"] is not None, f"{what}: an injected divergence was not reported"
            assert r["injected_into"] in r["injected"] and "tp group" in r["injected"], (what, r["injected"])
            # without it the replicas drift, and the check names the parameter
            assert r["drift_without"] is not None, f"{what}: replicas did not drift without the random-state tracker"
            assert r["drift_without"].startswith("parameter "), (what, r["drift_without"])
            # same run seed, same run; a recomputing plan draws the same masks
            assert r["drift_again"] is None and r["again"] == r["losses"], (what, r["again"], r["losses"])
            if "'pp'" not in r["case"]:  # without pipeline stages, recomputed
                assert r["drift_recompute"] is None, (what, r["drift_recompute"])
                assert r["recompute_losses"] == r["losses"], (what, r["recompute_losses"], r["losses"])


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
