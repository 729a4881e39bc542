"""ZeRO stages 1-3 (runtime/zero.py) on real gloo processes, against a single-process reference.

Each launch (2 and 4 ranks) runs every check in one mp.spawn (see zero_worker.py):
stages 1, 2, 3 x MLP and tiny GPT x AdamW and SGD-momentum, 2 micro-batches, 3
steps, eager forward; stage 3 also through a functional forward that fetches
parameters by name (the fx Interpreter's way); 1 micro-batch per stage for the
plan's per-step traffic; an MLP of odd sizes whose shards need padding. Losses, first-step gradients and final parameters
within fp32 tolerance; model-state bytes held equal to the cost model's plus
padding; bytes sent per step equal to zero_traffic_elements (over padded buckets).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # spawned ranks inherit sys.path
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import zero_worker  # noqa: E402
from dp_worker import free_port  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_single_process_and_the_cost_model(world, tmp_path):
    mp.spawn(zero_worker.worker, args=(world, free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 19
        for r in results:
            print(rank, r)
