"""Planning time of the pipeline cut solver on 80- and 96-layer models.

Run: ``.venv/bin/python benchmarks/pp_planning_time.py``. Shapes are fake tensors,
so neither model costs memory. Each model is timed in three parts: capture
(torch.export), analysis (the profile's analyses, then the pipeline's own:
order, allowed boundaries, live bytes per boundary = ``node_costs``), and the
solve (``choose_pipeline``: every (p, dp, micro-batch, schedule) with one exact
DP each, plus a least-memory DP where a candidate does not fit). One DP at
p = 8 is also timed alone.

Measured on the 2-core CPU dev machine (torch 2.13 CPU), bf16 mixed precision, AdamW,
global batch 64, DGX A100 nodes, 8-way (ideal) tensor parallelism inside each stage, one
run while other jobs shared the machine (load average 4 on 2 cores, so times are
upper bounds; an earlier run had capture at 9.9 s for Llama):

    | model                     | layers | graph nodes | cut places | capture | analysis | PP costs | solve  | DPs | one DP, p=8 |
    | Llama-2-70B [1,4096]      |     80 |        5840 |         81 |  16.0 s |    1.9 s |  0.04 s  | 0.68 s |  74 |       11 ms |
    | GPT-3 175B  [1,2048]      |     96 |        3666 |         97 |   5.7 s |    0.9 s |  0.02 s  | 0.81 s |  77 |       11 ms |

    chosen: Llama-2-70B pp=4 dp=2 tp=8, m=32 1F1B, step 9.63 s, bubble 8%;
            GPT-3 175B  pp=8 dp=2 tp=8, m=32 1F1B, step 6.68 s, bubble 17%.

(64 GPUs = 8 nodes for Llama, 128 GPUs = 16 nodes for GPT-3.) The solve is a
small fraction of capture: the DP is O(p K^2) segment evaluations with K the
layer boundaries (81, 97), not the thousands of graph nodes, because cuts are
allowed only between repeated layers; most of the solve is the least-memory DPs
run for the candidates that do not fit (30 of 47 for GPT-3), and building the
per-node costs once per micro-batch size (7 sizes). "PP costs" is one
``node_costs`` (order, boundaries, live bytes per boundary) at micro-batch 1.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from examples.models import GPT, GPTConfig, llama2_70b
from partita.core.cluster import PRESETS
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.passes.cost_model import state_bytes_per_param
from partita.passes.pipeline.costs import node_costs
from partita.passes.pipeline.cuts import Partition, StageSetup, solve_cuts
from partita.passes.pipeline.stages import choose_pipeline, stage_links
from partita.passes.profile import profile_model

TP = 8


def gpt3_175b() -> GPT:
    """GPT-3 175B's shape: 96 layers, hidden 12288, 96 heads, vocab 50257, context 2048."""
    return GPT(GPTConfig(vocab_size=50257, block_size=2048, n_layer=96, n_head=96, n_embd=12288))


CASES = [
    ("Llama-2-70B", llama2_70b, "input_ids=int64[1,4096]", 8),
    ("GPT-3 175B", gpt3_175b, "idx=int64[1,2048]", 16),
]


def run(name, factory, spec, nodes, batch=64):
    captured = capture(factory, [parse_input_spec(spec)], name=name, loss=default_loss)
    t = time.perf_counter()
    profile = profile_model(captured)
    analysis = time.perf_counter() - t
    cluster = PRESETS["dgx-a100"].with_nodes(nodes)
    request = TrainingRequest(global_batch=batch, precision="bf16-mixed")
    t = time.perf_counter()
    costs = node_costs(profile, cluster, request, 1, tp=TP)
    pp_costs = time.perf_counter() - t
    t = time.perf_counter()
    decision = choose_pipeline(profile, cluster, request, Pins(), devices_per_stage=TP, costs=lambda mb: costs
                               if mb == 1 else node_costs(profile, cluster, request, mb, tp=TP))
    solve = time.perf_counter() - t
    setup = StageSetup(8, batch, "1f1b", stage_links(cluster, 8, cluster.world_size // (8 * TP), TP),
                       cluster.usable_memory, state_bytes_per_param("bf16-mixed", "adamw"))
    part = Partition(costs, setup, cluster)
    t = time.perf_counter()
    solve_cuts(part)
    one = time.perf_counter() - t
    b = decision.best
    return dict(
        model=f"{name} {spec.split('=')[1][5:]}, B={batch}", layers=str(sum(len(r.indices) for r in profile.repeated)),
        nodes=str(profile.num_nodes), cuts=str(len(costs.boundaries)), capture=f"{captured.seconds:.1f} s",
        analysis=f"{analysis:.1f} s", pp_costs=f"{pp_costs:.2f} s", solve=f"{solve:.2f} s", dps=str(decision.solves),
        one=f"{one * 1e3:.0f} ms",
        chosen=f"pp={b.pp} dp={b.dp} tp={b.tp}, m={b.micro_batches} {b.schedule.upper()}, "
               f"step {b.step_s:.2f} s, bubble {b.cost.bubble_s / b.step_s:.0%}",
    )


def main() -> None:
    table = Table(title=f"pipeline planning time (DGX A100 nodes, bf16-mixed AdamW, tp={TP} per stage)")
    cols = [("model", "model"), ("layers", "layers"), ("nodes", "graph nodes"), ("cuts", "cut places"),
            ("capture", "capture"), ("analysis", "analysis"), ("pp_costs", "PP costs"), ("solve", "solve"),
            ("dps", "DPs"), ("one", "one DP, p=8"), ("chosen", "chosen")]
    for _, title in cols:
        table.add_column(title, justify="left" if title in ("model", "chosen") else "right")
    for case in CASES:
        row = run(*case)
        table.add_row(*(row[k] for k, _ in cols))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
