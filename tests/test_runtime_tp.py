"""Tensor-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many checks in one mp.spawn (see tp_worker.py): tp=2 (example
GPT, MLP, an all-replicated plan that must match exactly, weights from a
checkpoint into a meta-device module, HF GPT-2, HF Llama), tp=4 (GPT, MLP) and
dp=2 x tp=2; losses each step, first-step gradients and parameters after 3
steps within fp32 tolerance, and the collectives counted per step equal to
the plan's.
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
import tp_worker  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(tp_worker.LAUNCHES))
def test_tensor_parallel_matches_single_process(launch, tmp_path):
    world, _ = tp_worker.LAUNCHES[launch]
    dp_worker.spawn_launch(tp_worker.worker, world, launch, tmp_path)
