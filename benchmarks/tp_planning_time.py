"""Planning time of the tensor-parallel solve for GPT-shaped graphs on this 2-core machine.

Each model is examples/models.py's GPT built from a ``GPTConfig`` with the
shapes below, captured under FakeTensorMode (no parameter memory) with its
cross-entropy loss, at micro-batch 1 and the model's context length; then
profiled (FLOPs, saved activations, repeated layers); then one TP ILP is
built and solved for an 8-GPU TP group of a DGX A100 (dp=16, no memory
budget: the solve time is the point, and the 70B and 175B shapes fit 80 GB
only with pipeline stages or ZeRO besides TP; the layout's memory is printed).

    python benchmarks/tp_planning_time.py            # the table
    python benchmarks/tp_planning_time.py --solvers  # also SCIP, CBC, CP-SAT (1 worker) on each

Measured here (2 cores, torch 2.13 CPU, OR-Tools 9.15 / HiGHS 1.12):

    model               params  nodes  classes  capture  analysis  build  HiGHS  SCIP  CBC   CP-SAT  micro-batch  memory
    GPT-2 small          0.16B    474       56      3.2      0.6   0.02   0.04  0.02  0.02   0.03       5.1 ms     1 GB
    7B-ish               6.72B   1234       56      4.3      0.6   0.07   0.05  0.03  0.03   0.05     166.2 ms    22 GB
    70B-ish             64.99B   3058       56      8.0      1.7   0.16   0.05  0.04  0.02   0.05    1231.7 ms   169 GB
    GPT-3 175B         175.22B   3666       56      6.6      1.1   0.21   0.03  0.02  0.01   0.03    1492.0 ms   386 GB
    GPT-2 small untied   0.16B    474      474      0.8      0.1   0.04   0.30  0.28  0.09   0.18       5.1 ms     1 GB
    7B-ish untied        6.72B   1234     1234      2.5      0.3   0.10   1.07  1.30  0.37   1.93     166.2 ms    22 GB

(seconds unless marked; capture varies 2x between runs with what else the
machine does. The ILP build calls the strategy rules once per node, since tied
layers keep their own strategies (their inputs' gradients can differ): 0.07 ->
0.21 s for GPT-3 175B, the solve unchanged.) Tying the repeated layers makes every shape the same 56
classes (one layer + embedding + head), so the solve is hundredths of a
second at any depth; the untied models give the same optimum here (same
micro-batch time) at 10-30x the solve time, and are what tells the solvers
apart: CBC fastest, the default in passes/tp/ilp.py. The capture dominates
planning time.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from examples.models import GPT, GPTConfig
from partita.core.cluster import PRESETS
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.passes.profile import profile_model
from partita.passes.tp.ilp import SOLVERS, solve_tp
from partita.passes.tp.problem import TPSetting, build_problem

# name: (layers, hidden, heads, vocab, context)
MODELS = {
    "GPT-2 small": (12, 768, 12, 50257, 1024),
    "7B-ish": (32, 4096, 32, 32000, 4096),
    "70B-ish": (80, 8192, 64, 32000, 4096),
    "GPT-3 175B": (96, 12288, 96, 50257, 2048),
}


def measure(name: str, solvers: tuple[str, ...], tie: bool = True) -> dict:
    layers, hidden, heads, vocab, ctx = MODELS[name]
    cfg = GPTConfig(vocab_size=vocab, block_size=ctx, n_layer=layers, n_head=heads, n_embd=hidden)
    t0 = time.perf_counter()
    captured = capture(lambda: GPT(cfg), [parse_input_spec(f"idx=int64[1,{ctx}]")], loss=default_loss)
    capture_s = time.perf_counter() - t0
    profile = profile_model(captured)
    cluster = PRESETS["dgx-a100"]
    setting = TPSetting(8, 1, 1, "bf16-mixed", dp=16)
    t1 = time.perf_counter()
    problem = build_problem(profile.graph, setting, cluster, repeated=profile.repeated if tie else ())
    build_s = time.perf_counter() - t1
    row = {"model": name + ("" if tie else " (untied)"), "params": profile.num_params, "nodes": profile.num_nodes,
           "classes": len(problem.classes),
           "capture_s": capture_s, "analysis_s": profile.analysis_seconds, "build_s": build_s, "solves": {}}
    for solver in solvers:
        sol = solve_tp(problem, solver=solver)
        row["solves"][solver] = sol
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--solvers", action="store_true", help="time SCIP, CBC and CP-SAT too")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--untied", nargs="*", default=["GPT-2 small", "7B-ish"],
                    help="models also solved without tying the repeated layers (a bigger ILP, to compare solvers)")
    args = ap.parse_args()
    solvers = SOLVERS if args.solvers else ("HIGHS",)
    table = Table(title="TP solve, t=8 on dgx-a100, micro-batch 1 (seconds)")
    for col in ("model", "params", "nodes", "classes", "capture", "analysis", "ILP build",
                *(f"{s} solve" for s in solvers),
                "status", "variables", "micro-batch ms", "memory GB"):
        table.add_column(col, justify="right")
    runs = [(name, True) for name in args.models] + [(name, False) for name in args.untied]
    for name, tie in runs:
        r = measure(name, solvers, tie)
        h = r["solves"]["HIGHS"]
        table.add_row(r["model"], f"{r['params'] / 1e9:.2f}B", str(r["nodes"]), str(r["classes"]),
                      f"{r['capture_s']:.1f}",
                      f"{r['analysis_s']:.1f}", f"{r['build_s']:.2f}",
                      *(f"{r['solves'][s].report.solve_seconds:.2f}" for s in solvers),
                      h.report.status, str(h.report.variables), f"{h.time_s * 1e3:.1f}", f"{h.memory_bytes / 1e9:.0f}")
        for s in solvers:
            assert math.isclose(r["solves"][s].report.objective_s, h.report.objective_s, rel_tol=1e-6), s
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
