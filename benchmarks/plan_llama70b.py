"""Plan Llama-2-70B at its natural batch, capture to plan, and report the time of each phase.

Run: ``.venv/bin/python benchmarks/plan_llama70b.py [BATCH] [NODES]`` (default input
input_ids=int64[512,4096] on 8 dgx-h100 nodes: the issue-12 case, with no --batch trick).

Measured on the 2-core dev machine while two other jobs shared it (upper bounds), one run:

    76.7 s capture to plan; phases: capture 16.6 s, analysis 2.7 s, batch_shapes 15.9 s (the capture
    at 1024 that gives every tensor's shape at each micro-batch), solve 22.1 s, layout 18.3 s (the
    capture at micro-batch 1, whose graph differs from batch 512's: TP layout solved again there)
    mesh dp=8 x tp=8 x pp=1, micro-batch 1 x 64, ZeRO-1, step 36.30 s, memory 64.2 GB

Before issue 12 this input failed ("capturing ... at micro-batch 1 gave another graph than at batch 512").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import llama2_70b
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options


def main(batch: int = 512, nodes: int = 8) -> None:
    start = time.perf_counter()
    options = Options(inputs=[parse_input_spec(f"input_ids=int64[{batch},4096]")],
                      cluster=load_cluster("dgx-h100", nodes=nodes))
    result = compile_model(llama2_70b, options, name="Llama-2-70B")
    plan = result.plan
    print(f"{time.perf_counter() - start:.1f} s capture to plan; phases: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in plan.analysis_seconds.items()))
    print(f"mesh {plan.mesh}, micro-batch {plan.training.micro_batch_size} x {plan.training.grad_accum_steps}, "
          f"ZeRO-{plan.training.zero_stage}, step {plan.predicted.step_time_s:.2f} s, "
          f"memory {plan.predicted.memory.total / 1e9:.1f} GB")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
