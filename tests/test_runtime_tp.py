"""Tensor-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many checks in one mp.spawn (see tp_worker.py): tp=2 (example
GPT, MLP, an all-replicated plan that must match exactly, weights from a
checkpoint into a meta-device module, HF GPT-2, HF Llama), tp=4 (GPT, MLP) and
dp=2 x tp=2; losses each step, first-step gradients and parameters after 3
steps within fp32 tolerance, and the collectives counted per step equal to
the plan's.
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

import tp_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(tp_worker.LAUNCHES))
def test_tensor_parallel_matches_single_process(launch, tmp_path):
    world, _ = tp_worker.LAUNCHES[launch]
    mp.spawn(tp_worker.worker, args=(launch, tp_worker.free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for r in results:
            print(rank, r)
