"""User errors under `partita run` (tests/test_launch.py): each ends as one message, exit 2.

usage: launch_script.py CASE    (CASE: batch | other-data | fine)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import partita  # noqa: E402
import tied_script as script  # noqa: E402

if __name__ == "__main__":
    case = sys.argv[1]
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    batch = model.plan.training.global_batch
    g = torch.Generator().manual_seed(model.ctx.rank if case == "other-data" else 0)
    seq = torch.randint(0, script.VOCAB, (batch + (2 if case == "batch" else 0), script.SEQ + 1), generator=g)
    model.train_step(seq[:, :-1], targets=seq[:, 1:])
    print("step done", flush=True)
