"""Predicted against measured step time on this machine, per collective kind: calibrate, plan, run.

1. ``partita calibrate`` measures matmul FLOP/s per process, gloo's all-reduce alpha/beta, and
   each collective kind's fixed cost per call for N processes (runtime/calibrate.py);
2. the example GPT (wider than the demo's, so that compute is measurable) is planned for that
   cluster four ways: free (the planner's choice), tp=2 (the planner's own layout), ZeRO-3 at
   dp=N, and pp=2;
3. each plan runs for a number of steps on N gloo processes; rank 0 reports the median step time
   and, per (collective kind, mesh axis), the seconds a step spent blocked in such calls
   (``CollectiveCounter.blocking``), beside the plan's prediction for rank 0's stage.

Run: ``.venv/bin/python benchmarks/predicted_vs_measured.py [NPROC ...]`` (default 2). Each row's
figures are measured side by side in one run; repeat runs move them by 10-25% on this machine
(shared/TORCH_ON_CPU.md). Results are in the README's Measured section.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, SEQ, STEPS, WARMUP = 16, 128, 10, 3


def model():
    from examples.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=1024, block_size=SEQ, n_layer=4, n_head=4, n_embd=256))


def worker(plan_path: str, out: str) -> None:
    import partita

    m = partita.parallelize(model(), plan=plan_path)
    g = torch.Generator().manual_seed(0)
    times, blocked = [], collections.Counter()
    for i in range(WARMUP + STEPS):
        x = torch.randint(0, 1024, (BATCH, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        m.train_step(x[:, :-1], targets=x[:, 1:])
        times.append(time.perf_counter() - t0)
        if i >= WARMUP:
            blocked.update({f"{k}/{a}": s / STEPS for (k, a), s in m.collectives.seconds.items()})
    calls = collections.Counter()  # the last step's calls, by kind/axis
    for (k, a, _), n in m.collectives.calls.items():
        calls[f"{k}/{a}"] += n
    if m.ctx.rank == 0:
        Path(out).write_text(json.dumps({"times": times[WARMUP:], "blocked": blocked, "calls": calls}))


def predicted_by_kind(plan) -> dict[str, float]:
    """Seconds per step the plan predicts for rank 0's collectives, by "kind/axis"."""
    out: dict[str, float] = collections.Counter()
    for c in plan.collectives:
        if c.stage in (None, 0):
            out[f"{c.kind}/{c.axis}"] += c.seconds
    return dict(out)


def run_plan(plan, n: int) -> dict:
    from partita.runtime.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        path = plan.save(Path(tmp) / "plan.json")
        out = Path(tmp) / "times.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        rc = run_torchrun(n, [__file__, "--worker", str(path), str(out)], env=env)
        if rc:
            raise SystemExit(f"the {n}-process run failed ({rc})")
        return json.loads(out.read_text())


def main(nprocs: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    from partita.compiler.cli import calibrated_cluster
    from partita.compiler.compile import compile_model
    from partita.core.inputs import parse_input_spec
    from partita.compiler.report import fmt_time
    from partita.passes.constraints import Pins
    from partita.runtime.calibrate import calibrate

    console = Console(width=170)
    steps = Table(title="predicted vs measured step time (gloo, this machine)")
    for col in ("processes", "plan", "mesh", "predicted", "measured (median)", "measured / predicted"):
        steps.add_column(col, justify="right")
    kinds = Table(title="per collective kind, seconds per step on rank 0 (predicted vs measured blocked time)")
    for col in ("processes", "plan", "kind/axis", "calls", "predicted", "measured", "measured / predicted"):
        kinds.add_column(col, justify="right")
    for n in nprocs:
        r = calibrate(n)
        cluster = calibrated_cluster(r)
        console.print(f"{n} processes: {r.matmul_flops / 1e9:.1f} GFLOP/s/proc, beta {r.allreduce_beta / 1e9:.2f} GB/s, "
                      f"alpha {fmt_time(r.allreduce_alpha)}, cost per call: "
                      + ", ".join(f"{k} {fmt_time(v)}" for k, v in cluster.call_latency.items()))
        spec = parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")
        cases = {"free": Pins(world_size=n), f"tp={n}": Pins(world_size=n, tp=n),
                 f"zero3 dp={n}": Pins(world_size=n, dp=n, zero_stage=3), "pp=2": Pins(world_size=n, pp=2)}
        for name, pins in cases.items():
            plan = compile_model(model, [spec], cluster, pins=pins).plan
            got = run_plan(plan, n)
            measured = statistics.median(got["times"])
            p = plan.predicted
            steps.add_row(str(n), name, str(plan.mesh), fmt_time(p.step_time_s), fmt_time(measured),
                          f"{measured / p.step_time_s:.2f}")
            predicted = predicted_by_kind(plan)
            for key in sorted(set(predicted) | set(got["blocked"])):
                pr, me = predicted.get(key, 0.0), got["blocked"].get(key, 0.0)
                kinds.add_row(str(n), name, key, str(got["calls"].get(key, 0)), fmt_time(pr), fmt_time(me),
                              f"{me / pr:.2f}" if pr > 0 else "-")
    console.print(steps)
    console.print(kinds)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main([int(a) for a in sys.argv[1:]] or [2])
