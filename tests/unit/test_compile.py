"""``compile=True``: each rank's program through ``torch.compile`` (inductor's C++ backend on this CPU).

A one-process plan that recomputes every layer (its program has recomputed sub-programs and random
ops) is compiled whole and trains like the same plan uncompiled, and like one plain process; where a
program cannot be whole, one line says where the graph breaks and it runs compiled in pieces."""

from __future__ import annotations

import copy

import torch

from examples.models import gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.options import Options
from partita.runtime.engine import ParallelModel
from partita.runtime.tp.program import compiled
from tests.harness import beyond, gaps, numbers_beyond, reference_step
from tests.workers.dp_worker import OPTIMIZERS, SEQ, gpt_batch, gpt_loss

# fp32; inductor fuses and reorders the sums of the same numbers
RTOL, ATOL = 1e-4, 1e-5
STEPS, BATCH = 2, 8
def test_a_compiled_recomputing_plan_trains_as_one_process(capsys):
    options = Options(inputs=[f"idx=int64[{BATCH},{SEQ}]"], cluster="local", devices=1, world_size=1,
                      loss=gpt_loss, optimizer=OPTIMIZERS["adamw"], recompute=True)
    plan = compile_model(gpt_tiny, options).plan
    torch.manual_seed(0)
    reference = gpt_tiny()
    model = ParallelModel(copy.deepcopy(reference), plan, options.replace(compile=True, log_every=0))
    ref_opt = OPTIMIZERS["adamw"](reference.parameters())
    x, y = gpt_batch(BATCH)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        losses.append(float(model.train_step(x, targets=y)))
        ref_losses.append(reference_step(reference, ref_opt, gpt_loss, x, y,
                                         micro_batch=plan.training.micro_batch_size))
    assert not numbers_beyond(losses, ref_losses, rtol=RTOL, atol=ATOL), (losses, ref_losses)
    found = gaps(model.full_state_dict(buffers=False), dict(reference.named_parameters()))
    assert not beyond(found, rtol=RTOL, atol=ATOL)
    assert "torch.compile" not in capsys.readouterr().out  # taken whole: nothing to report


def test_a_graph_break_is_reported_in_one_line_and_the_result_is_the_same(capsys):
    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()  # what a collective in a rank's program does to the compiler
        return y.cos()

    run = compiled(broken, "the test's program")
    x = torch.randn(5)
    torch.testing.assert_close(run(x), x.sin().cos())
    torch.testing.assert_close(run(x), x.sin().cos())
    lines = [line for line in capsys.readouterr().out.splitlines() if "torch.compile" in line]
    assert len(lines) == 1 and "the test's program breaks the graph" in lines[0], lines
