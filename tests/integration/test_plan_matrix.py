"""Every plan the planner writes for a small example model runs (issue 16).

The example models (a 4-layer 1024-wide MLP, SmallCNN, the tiny GPT, tiny HF
GPT-2 and Llama) are compiled under the CLI's pins on 2 local devices (dp, tp,
pp with GPipe and 1F1B, ZeRO 1/2/3, recomputation) and some on 4 (dp x tp with
ZeRO-2, tp x pp recomputing, dp x pp with ZeRO-1), and each plan runs one
training step on real gloo processes against a single-process reference
(matrix_worker.py measures, the test asserts). Two launches in all: the first compiles every case
and runs the 2-device plans, the second runs the 4-device ones.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import beyond, launch, numbers_beyond
from tests.workers import matrix_worker

# fp32: a plan sums the same numbers as one process, in another order (dp, tp, stages, micro-batches)
RTOL, ATOL = 1e-4, 2e-5


def _assert_like_one_process(r: dict, rank: int) -> None:
    what = f"rank {rank} {r['case']} ({r['mesh']}, {r['schedule']}, ZeRO-{r['zero']})"
    assert not numbers_beyond([r["evaluated"]], [r["ref_evaluated"]], rtol=RTOL, atol=ATOL), f"{what}: evaluate"
    assert not numbers_beyond([r["loss"]], [r["ref_loss"]], rtol=RTOL, atol=ATOL), f"{what}: loss"
    assert not r["names_unlike_the_models"], (what, r["names_unlike_the_models"])
    assert not beyond(r["params"], rtol=RTOL, atol=ATOL), f"{what}: parameters after the step"
    assert r["moved"] > 10 * ATOL, (what, r["moved"])  # the step moves the parameters well past the tolerance
def test_every_plan_of_the_example_models_runs_one_step_like_one_process(tmp_path):
    two = launch(2, matrix_worker.compile_and_run_2, str(tmp_path))
    four = launch(4, matrix_worker.run_4, str(tmp_path))
    for rank, results in [*enumerate(two), *enumerate(four)]:
        for r in results:
            if "refused" not in r:
                _assert_like_one_process(r, rank)
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
