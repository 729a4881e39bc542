"""ZeRO composed with tensor and pipeline parallelism on real gloo processes (see zero_mesh_worker.py).

dp=2 x pp=2 (ZeRO-1 under 1F1B, ZeRO-2 under GPipe, ZeRO-3 under 1F1B, and a
tied-embedding GPT whose shared weight stays out of ZeRO) and dp=2 x tp=2
(ZeRO-3 gathering inside the TP interpreter, GPT and HF Llama), 4 processes
each: losses, gradients and parameters against one process, model state held
against the cost model, and the dp collectives call for call.
"""

from __future__ import annotations

import pytest

import zero_mesh_worker
from harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(zero_mesh_worker.LAUNCHES))
def test_zero_with_tp_and_pp_matches_single_process(name, tmp_path):
    world, checks = zero_mesh_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    cases = {r["case"] for results in per_rank for r in results}
    assert len(cases) == len(per_rank[0])
