"""Every plan the planner writes for a small example model runs (issue 16).

The example models (a 4-layer 1024-wide MLP, SmallCNN, the tiny GPT, tiny HF
GPT-2 and Llama) are compiled under the CLI's pins on 2 local devices (dp, tp,
pp with GPipe and 1F1B, ZeRO 1/2/3, recomputation) and some on 4 (dp x tp with
ZeRO-2, tp x pp recomputing, dp x pp with ZeRO-1), and each plan runs one
training step on real gloo processes against a single-process reference
(matrix_worker.py). Two launches in all: the first compiles every case and runs
the 2-device plans, the second runs the 4-device ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import matrix_worker
from harness import launch


@pytest.mark.slow
def test_every_plan_of_the_example_models_runs_one_step_like_one_process(tmp_path):
    two = launch(2, matrix_worker.compile_and_run_2, str(tmp_path))
    four = launch(4, matrix_worker.run_4, str(tmp_path))
    results = {r["case"]: r for r in two[0] + four[0]}
    assert set(results) == {c.name for c in matrix_worker.CASES}
    refused = {name: r["refused"] for name, r in results.items() if "refused" in r}
    for name, why in sorted(refused.items()):
        print("refused by the planner:", name, why)
    # The planner may refuse a pin it cannot honour for a model, but not these: issue 16's MLP at
    # tp=2, and every pin on the GPT, the model the planner is built around.
    assert not {"mlp/tp2", "mlp/tp2-recompute"} & set(refused), refused
    assert not [n for n in refused if n.startswith("gpt/")], refused
    ran = [r for r in results.values() if "refused" not in r]
    assert len(ran) >= 0.75 * len(results), refused
    assert any(r["split"] and r["mesh"].startswith("dp=1 x tp=2") for r in ran if r["case"].startswith("mlp/"))
    Path(tmp_path, "summary.json").write_text(json.dumps(results, indent=1))
