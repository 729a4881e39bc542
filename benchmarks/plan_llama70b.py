"""Plan Llama-2-70B at its natural batch, capture to plan, and report the time of each phase.

Run: ``.venv/bin/python benchmarks/plan_llama70b.py [BATCH] [NODES]`` (default input
input_ids=int64[512,4096] on 8 dgx-h100 nodes: the issue-12 case, with no --batch trick).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import llama2_70b  # noqa: E402
from partita.compiler.compile import compile_model  # noqa: E402
from partita.compiler.inputs import parse_input_spec  # noqa: E402
from partita.passes.cluster import load_cluster  # noqa: E402


def main(batch: int = 512, nodes: int = 8) -> None:
    start = time.perf_counter()
    result = compile_model(llama2_70b, [parse_input_spec(f"input_ids=int64[{batch},4096]")],
                           load_cluster("dgx-h100", nodes=nodes), name="Llama-2-70B")
    plan = result.plan
    print(f"{time.perf_counter() - start:.1f} s capture to plan; phases: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in plan.analysis_seconds.items()))
    print(f"mesh {plan.mesh}, micro-batch {plan.training.micro_batch_size} x {plan.training.grad_accum_steps}, "
          f"ZeRO-{plan.training.zero_stage}, step {plan.predicted.step_time_s:.2f} s, "
          f"memory {plan.predicted.memory.total / 1e9:.1f} GB")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
