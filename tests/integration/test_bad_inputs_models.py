"""Bad input, the model's side (issue 29): the runs on several processes
(tests/unit/test_bad_inputs_models.py has the single-process checks)."""

from __future__ import annotations

import pytest

from tests.harness import WORKERS, partita_cli
from tests.unit.test_bad_inputs_guards import snapshot, within


@pytest.mark.parametrize("case, expected", [
    ("error-on-one-rank", "error (rank 1): train_step got input 0 (idx) with shape"),
    ("ends-early", "error (rank 0): rank 1's script ended while rank 0 was still in"),
])
def test_one_ranks_failure_is_one_message_from_the_rank_that_knows(dp2_plan, case, expected):
    """Rank 1 passes a batch of another shape at step 2 (its own user error), or its script ends
    after one step: the run ends with exit 2 and one message, said by the rank that knows what
    happened, without the gloo traceback of the rank left waiting in a collective."""
    before = snapshot(dp2_plan.parent)
    with within(180):  # two processes start, import torch and plan on a 2-core machine
        r = partita_cli("run", dp2_plan, WORKERS / "peer_script.py", case, check=False)
    text = r.stdout + r.stderr
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert r.returncode == 2 and len(errors) == 1 and expected in errors[0], text[-3000:]
    assert "hint: " in text.split(errors[0], 1)[1], text[-3000:]
    assert "Traceback" not in text and "Connection closed" not in text and "ChildFailedError" not in text
    assert snapshot(dp2_plan.parent) == before
