"""User errors under `partita run` (tests/unit/test_launch.py): each ends as one message, exit 2.

usage: launch_script.py CASE    (CASE: batch | other-data | fine; the repository's root on PYTHONPATH)
"""

import sys

import torch

import partita
from tests.workers import tied_script as script

if __name__ == "__main__":
    case = sys.argv[1]
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer)
    batch = model.plan.training.global_batch
    g = torch.Generator().manual_seed(model.ctx.rank if case == "other-data" else 0)
    seq = torch.randint(0, script.VOCAB, (batch + (2 if case == "batch" else 0), script.SEQ + 1), generator=g)
    model.train_step(seq[:, :-1], targets=seq[:, 1:])
    print("step done", flush=True)
