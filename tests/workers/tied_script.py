"""Tied models through the planner's own pipeline plans (run on the harness's groups, ``run``, at 4 ranks by
tests/integration/test_runtime_tied.py and at 8 by test_mesh8.py; imported for the single-process reference).

usage: tied_script.py OUTDIR NAME=PLAN.json [NAME=PLAN.json ...]   (the repository's root on PYTHONPATH)

Each rank trains each named model under its plan and writes OUTDIR/NAME.rankR.json: the losses,
the collectives it counted on the last step and those its plan lists for its stage; rank 0 also
writes the gathered parameters to OUTDIR/NAME.pt.
"""

import json
import sys
from pathlib import Path

import torch

import partita
from examples.models import GPT, GPTConfig, hf_bert_mlm

STEPS, SEQ, VOCAB = 3, 16, 256


class TiedGPT(GPT):
    """GPT-2's tying: the head's weight is the token embedding's."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.lm_head.weight = self.transformer.wte.weight


def bert() -> torch.nn.Module:
    return hf_bert_mlm(vocab_size=VOCAB)


def tied_gpt() -> torch.nn.Module:
    return TiedGPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64))


MODELS = {"bert": bert, "tied-gpt": tied_gpt}
INPUT = {"bert": "input_ids", "tied-gpt": "idx"}  # each forward's argument


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def optimizer(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5)


def batches(batch: int):
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        seq = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        yield seq[:, :-1], seq[:, 1:]


def main(outdir: Path, runs: list[str]) -> None:
    for run in runs:
        name, plan = run.split("=", 1)
        model = partita.parallelize(build(name), plan=plan, optimizer=optimizer)
        losses = [model.train_step(x, targets=y) for x, y in batches(model.plan.training.global_batch)]
        counted = [list(t) for t in model.collectives.as_tuples()]
        rank = model.ctx.rank
        stage = model.plan.mesh.coords(rank)["pp"]
        planned = [[c.kind, c.axis, c.bytes, c.count] for c in model.plan.collectives if c.stage in (None, stage)]
        state = model.full_state_dict()
        Path(outdir, f"{name}.rank{rank}.json").write_text(json.dumps(
            {"losses": losses, "counted": counted, "planned": planned, "stage": stage}))
        if rank == 0:
            torch.save(state, Path(outdir, f"{name}.pt"))


def run(ctx, outdir: str, runs: list[str]) -> None:
    """tests/harness.py's entry: ``main`` on a running group."""
    main(Path(outdir), runs)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
