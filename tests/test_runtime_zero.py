"""ZeRO stages 1-3 (runtime/dp/zero.py) on real gloo processes, against a single-process reference.

Each launch (2 and 4 ranks) runs every check (see zero_worker.py):
stages 1, 2, 3 x MLP and tiny GPT x AdamW and SGD-momentum, 2 micro-batches, 3
steps, eager forward; stage 3 also through a functional forward that fetches
parameters by name (the fx Interpreter's way); 1 micro-batch per stage for the
plan's per-step traffic; an MLP of odd sizes whose shards need padding. Losses, first-step gradients and final parameters
within fp32 tolerance; model-state bytes held equal to the cost model's plus
padding; bytes sent per step equal to zero_traffic_elements (over padded buckets).
"""

from __future__ import annotations

import pytest

import zero_worker
from harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_single_process_and_the_cost_model(world):
    for results in launch(world, zero_worker.checks):
        assert len(results) == 19
