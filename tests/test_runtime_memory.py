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

import pytest

import memory_worker
from harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(memory_worker.LAUNCHES))
def test_each_rank_holds_its_part_and_leaves_no_cycles(name, tmp_path):
    world, checks = memory_worker.LAUNCHES[name]
    per_rank = launch(world, checks, str(tmp_path))
    stages = {(r["case"], r["stage"]) for results in per_rank for r in results}
    assert stages == {("gpt/tp2", 0), ("gpt/pp2", 0), ("gpt/pp2", 1)}
