"""Each rank holds only its part of the plan, and nothing waits for the garbage collector (issue 16).

tp=2 and pp=2 plans of examples/models.py's GPT (4.2M parameters) on 2 gloo
processes, in one launch (memory_worker.py): the bytes of the tensors each rank
holds after building, at each optimizer step and after each step, against the
cost model's model state for the parameters the plan places on that rank, with
the garbage collector off; and no tensor in a reference cycle after a step.
Before issue 16 each rank also kept the whole model (17 MB) in the captured
program, and a pipeline stage's received activations waited for a collection.
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
import memory_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(memory_worker.LAUNCHES))
def test_each_rank_holds_its_part_and_leaves_no_cycles(launch, tmp_path):
    world, _ = memory_worker.LAUNCHES[launch]
    per_rank = dp_worker.spawn_launch(memory_worker.worker, world, launch, tmp_path)
    stages = {(r["case"], r["stage"]) for results in per_rank for r in results}
    assert stages == {("gpt/tp2", 0), ("gpt/pp2", 0), ("gpt/pp2", 1)}
