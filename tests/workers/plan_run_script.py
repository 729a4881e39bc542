"""Train the example GPT for 3 steps under the plan `partita run` gives, batches of the plan's
shapes; rank 0 writes the losses. Run by tests/unit/test_plan_mutations.py.

usage: plan_run_script.py OUT.json   (the repository's root on PYTHONPATH)
"""

import json
import sys
from pathlib import Path

import torch

import partita
from examples.models import gpt_tiny
from partita.core.inputs import parse_input_spec

if __name__ == "__main__":
    torch.manual_seed(0)
    model = partita.parallelize(gpt_tiny(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    batch, seq = parse_input_spec(model.plan.model.inputs[0]).shape
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
        losses.append(float(model.train_step(tokens[:, :-1], targets=tokens[:, 1:])))
    if model.ctx.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps([repr(x) for x in losses]))
