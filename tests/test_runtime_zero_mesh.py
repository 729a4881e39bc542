"""ZeRO composed with tensor and pipeline parallelism on real gloo processes (see zero_mesh_worker.py).

dp=2 x pp=2 (ZeRO-1 under 1F1B, ZeRO-2 under GPipe, ZeRO-3 under 1F1B, and a
tied-embedding GPT whose shared weight stays out of ZeRO) and dp=2 x tp=2
(ZeRO-3 gathering inside the TP interpreter, GPT and HF Llama), 4 processes
each: losses, gradients and parameters against one process, model state held
against the cost model, and the dp collectives call for call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # spawned ranks inherit sys.path
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import dp_worker  # noqa: E402
import zero_mesh_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(zero_mesh_worker.LAUNCHES))
def test_zero_with_tp_and_pp_matches_single_process(launch, tmp_path):
    world, _ = zero_mesh_worker.LAUNCHES[launch]
    per_rank = dp_worker.spawn_launch(zero_mesh_worker.worker, world, launch, tmp_path)
    cases = {r["case"] for results in per_rank for r in results}
    assert len(cases) == len(per_rank[0])
