"""Pipeline-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many checks in one mp.spawn (see pp_worker.py): pp=2 (example
GPT with GPipe and 1F1B, a tied-embedding GPT whose copies' gradients are
summed, forward-only inference), pp=4 (GPT with both schedules and their
traces, HF Llama whose rotary embeddings are relayed through the middle
stages), dp=2 x pp=2, tp=2 x pp=2, and dp=2 x tp=2 x pp=2 on 8 processes:
losses each step, first-step gradients and parameters after 3 steps per
stage, and the p2p sends per step equal to the tensors crossing the cuts.
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

import pp_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(pp_worker.LAUNCHES))
def test_pipeline_parallel_matches_single_process(launch, tmp_path):
    world, _ = pp_worker.LAUNCHES[launch]
    mp.spawn(pp_worker.worker, args=(launch, pp_worker.free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for r in results:
            print(rank, r)
