"""Train the example GPT for 3 steps under the plan `partita run` gives, batches of the plan's
shapes; rank 0 writes the losses. Run by tests/integration/test_plan_mutations.py on the harness's
ranks (``run_plan``); as a script, under `partita run PLAN.json plan_run_script.py OUT.json`.

usage: plan_run_script.py OUT.json   (the repository's root on PYTHONPATH)
"""

import json
import sys
from pathlib import Path

import torch

import partita
from examples.models import gpt_tiny
from partita.core.model.inputs import parse_input_spec


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = partita.parallelize(gpt_tiny(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    batch, seq = parse_input_spec(model.plan.model.inputs[0]).shape
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
        losses.append(float(model.train_step(tokens[:, :-1], targets=tokens[:, 1:])))
    if model.ctx.rank == 0:
        out.write_text(json.dumps([repr(x) for x in losses]))


def run_plan(ctx, plan: str, out: str) -> None:
    """tests/harness.py's entry: ``main`` on a running group, with ``plan`` as `partita run` passes it
    (PARTITA_PLAN)."""
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, {"PARTITA_PLAN": plan}):
        main(Path(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
