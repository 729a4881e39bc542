"""Predicted against measured step time on this machine, per collective kind: calibrate, plan, run.

1. ``partita calibrate`` measures matmul FLOP/s per process, gloo's all-reduce alpha/beta, and
   each collective kind's fixed cost per call for N processes (runtime/calibrate.py);
2. the example GPT (wider than the demo's, so that compute is measurable) is planned for that
   cluster four ways: free (the planner's choice), tp=2 (the planner's own layout), ZeRO-3 at
   dp=N, and pp=2; beside the planner's tp layout, Megatron-LM's hand layout of the same model
   runs too (measured only), to show whether the layout the search prefers is the faster one;
3. each plan runs for a number of steps on N gloo processes; rank 0 reports the median step time
   and, per (collective kind, mesh axis), the seconds a step spent blocked in such calls
   (``CollectiveCounter.blocking``), beside the plan's prediction for rank 0's stage; then every
   rank measures its matmul speed again as calibration does. The "speed-matched" ratio scales
   the measured / predicted ratio by that speed over the calibrated one: what the ratio would
   have been had the whole step run at the speed the prediction was made for (an approximation:
   communication does not scale with matmul speed, so it corrects the communication share too).

Run: ``.venv/bin/python benchmarks/predicted_vs_measured.py [--rounds R] [NPROC ...]`` (default 3
rounds on 2 processes). This 2-core machine's speed moves from minute to minute (one plan's
measured / predicted ratio moved 1.10 -> 1.60 between two runs a few minutes apart), so each round
calibrates afresh and runs every plan, and the summary gives each plan's median ratio over the
rounds with its range. Results are in the README's Measured section.
"""

from __future__ import annotations

import collections
import dataclasses
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
    # The machine's matmul speed right after the steps, every rank at once as calibration measures
    # it: this machine's speed drifts by 20-40% from minute to minute, and a prediction holds for
    # the speed it was calibrated at.
    from partita.runtime.calibrate import MATMUL_N, MATMUL_SECONDS, matmul_flops

    torch.distributed.barrier()
    flops = matmul_flops(MATMUL_N, MATMUL_SECONDS)
    if m.ctx.rank == 0:
        Path(out).write_text(json.dumps({"times": times[WARMUP:], "blocked": blocked, "calls": calls,
                                         "flops_after": flops}))


def predicted_by_kind(plan) -> dict[str, float]:
    """Seconds per step the plan predicts for rank 0's collectives, by "kind/axis"."""
    out: dict[str, float] = collections.Counter()
    for c in plan.collectives:
        if c.stage in (None, 0):
            out[f"{c.kind}/{c.axis}"] += c.seconds
    return dict(out)


def megatron_plan(n: int, like):
    """The example GPT at tp=n laid out by hand as Megatron-LM does (q/k/v and c_fc column-parallel,
    c_proj row-parallel, the embedding and the loss vocabulary-parallel: tests/tp_choice.py), to
    measure beside the planner's own tp layout ``like`` (a ``CompileResult``: the hand layout is
    made on its capture, for its cluster). It carries no prediction."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tp_choice import tp_plan

    from partita.core.model.inputs import InputSpec

    c, plan = like.captured, like.plan
    hand = tp_plan(None, [InputSpec(s.name, s.dtype, (BATCH, *s.shape[1:])) for s in c.inputs], None, c.targets,
                   tp=n, mbs=BATCH, accum=1, captured=c)
    return dataclasses.replace(hand, cluster=plan.cluster, model=plan.model)


def run_plan(plan, n: int) -> dict:
    from partita.runtime.processes.launch import run_torchrun

    with tempfile.TemporaryDirectory() as tmp:
        path = plan.save(Path(tmp) / "plan.json")
        out = Path(tmp) / "times.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}
        rc = run_torchrun(n, [__file__, "--worker", str(path), str(out)], env=env)
        if rc:
            raise SystemExit(f"the {n}-process run failed ({rc})")
        return json.loads(out.read_text())


def main(nprocs: list[int], rounds: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from partita.compiler.commands.calibrate import calibrated_cluster
    from partita.compiler.compile import compile_model
    from partita.compiler.report import fmt_time
    from partita.core.model.inputs import parse_input_spec
    from partita.core.options import Options
    from partita.runtime.calibrate import calibrate

    console = Console(width=170)
    steps = Table(title="predicted vs measured step time (gloo, this machine), each round calibrated afresh")
    for col in ("processes", "round", "plan", "mesh", "predicted", "measured (median)", "measured / predicted",
                "speed after run / calibrated", "speed-matched ratio"):
        steps.add_column(col, justify="right")
    kinds = Table(title="per collective kind, seconds per step on rank 0 (predicted vs measured blocked time)")
    for col in ("processes", "round", "plan", "kind/axis", "calls", "predicted", "measured", "measured / predicted"):
        kinds.add_column(col, justify="right")
    ratios: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    matched: dict[tuple[int, str], list[float]] = collections.defaultdict(list)  # as if run at calibrated speed
    versus: dict[int, list[float]] = collections.defaultdict(list)  # planner's tp layout / Megatron's, measured
    for n in nprocs:
        for rnd in range(1, rounds + 1):
            r = calibrate(n)
            cluster = calibrated_cluster(r)
            console.print(f"{n} processes, round {rnd}: {r.matmul_flops / 1e9:.1f} GFLOP/s/proc, "
                          f"beta {r.allreduce_beta / 1e9:.2f} GB/s, alpha {fmt_time(r.allreduce_alpha)}, "
                          "cost per call: "
                          + ", ".join(f"{k} {fmt_time(v)}" for k, v in cluster.call_latency.items()))
            spec = parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")
            cases = {"free": dict(world_size=n), f"tp={n}": dict(world_size=n, tp=n),
                     f"zero3 dp={n}": dict(world_size=n, dp=n, zero=3), "pp=2": dict(world_size=n, pp=2)}
            for name, pins in cases.items():
                result = compile_model(model, Options(inputs=[spec], cluster=cluster, **pins))
                plan = result.plan
                got = run_plan(plan, n)
                measured = statistics.median(got["times"])
                p = plan.predicted
                ratio, drift = measured / p.step_time_s, got["flops_after"] / r.matmul_flops
                ratios[n, name].append(ratio)
                matched[n, name].append(ratio * drift)
                steps.add_row(str(n), str(rnd), name, str(plan.mesh), fmt_time(p.step_time_s), fmt_time(measured),
                              f"{ratio:.2f}", f"{drift:.2f}", f"{ratio * drift:.2f}")
                if name == f"tp={n}":
                    hand = statistics.median(run_plan(megatron_plan(n, result), n)["times"])
                    versus[n].append(measured / hand)
                    steps.add_row(str(n), str(rnd), f"tp={n} Megatron (hand)", str(plan.mesh), "-", fmt_time(hand), "-")
                predicted = predicted_by_kind(plan)
                for key in sorted(set(predicted) | set(got["blocked"])):
                    pr, me = predicted.get(key, 0.0), got["blocked"].get(key, 0.0)
                    kinds.add_row(str(n), str(rnd), name, key, str(got["calls"].get(key, 0)), fmt_time(pr),
                                  fmt_time(me), f"{me / pr:.2f}" if pr > 0 else "-")
    console.print(steps)
    console.print(kinds)
    summary = Table(title=f"measured / predicted step time over {rounds} round(s)")
    for col in ("processes", "plan", "median", "min", "max", "speed-matched median", "min", "max"):
        summary.add_column(col, justify="right")
    for (n, name), rs in ratios.items():
        ms = matched[n, name]
        summary.add_row(str(n), name, f"{statistics.median(rs):.2f}", f"{min(rs):.2f}", f"{max(rs):.2f}",
                        f"{statistics.median(ms):.2f}", f"{min(ms):.2f}", f"{max(ms):.2f}")
    console.print(summary)
    for n, vs in versus.items():
        console.print(f"{n} processes: the planner's own tp={n} layout measured / Megatron's hand layout measured, "
                      f"by round: {', '.join(f'{v:.2f}' for v in vs)} (median {statistics.median(vs):.2f})")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        import argparse

        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("nproc", nargs="*", type=int, default=[2], help="process counts (default 2)")
        ap.add_argument("--rounds", type=int, default=3,
                        help="calibrate and run every plan this many times; the summary gives the median ratio")
        args = ap.parse_args()
        main(args.nproc, args.rounds)
