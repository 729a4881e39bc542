"""Tensor-parallel runtime on real gloo processes, against a single-process reference.

Each launch runs many checks (see tp_worker.py): tp=2 (example
GPT, MLP, an all-replicated plan that must match exactly, weights from a
checkpoint into a meta-device module, HF GPT-2, HF Llama), tp=4 (GPT, MLP) and
dp=2 x tp=2; losses each step, first-step gradients and parameters after 3
steps within fp32 tolerance, and the collectives counted per step equal to
the plan's.
"""

from __future__ import annotations

import pytest

import tp_worker
from harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(tp_worker.LAUNCHES))
def test_tensor_parallel_matches_single_process(name, tmp_path):
    world, checks = tp_worker.LAUNCHES[name]
    launch(world, checks, str(tmp_path))
