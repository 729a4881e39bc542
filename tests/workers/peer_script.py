"""One rank's failure under `partita run` (tests/unit/test_bad_inputs_models.py): it must end as one
message, from the rank that knows what happened.

usage: peer_script.py CASE   (CASE: error-on-one-rank | ends-early; the repository's root on PYTHONPATH)
"""

import sys

import torch

import partita
from tests.workers import tied_script as script

if __name__ == "__main__":
    case = sys.argv[1]
    model = partita.parallelize(script.build("tied-gpt"), optimizer=script.optimizer, log_every=0)
    batch = model.plan.training.global_batch
    seq = torch.randint(0, script.VOCAB, (batch, script.SEQ + 1), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        if model.rank == 1 and step == 1:
            if case == "ends-early":
                sys.exit(0)
            seq = seq[:, :-1]  # a shorter sequence on this rank only: its own user error
        model.train_step(seq[:, :-1], targets=seq[:, 1:])
    print("done", flush=True)
