"""A skewed router against a balanced one: predicted and measured step time at ep = 2 (issue 43).

Two Mixtral-shaped models alike but for their routers: one as initialised (near balanced), one whose
routers send every token to experts 2 and 3, both held by rank 1 of the expert group of 2 (every
token's hidden state leans on one dimension that only those experts' gate rows read, strongly enough
that training does not move it). For each, `partita calibrate --router`'s measurement
(runtime/experts.py ``measure_routing``) gives the router profile; the planner prices the plan
dp = 2, ep = 2 on 2 local processes with it (``--expert-load``); the plan then runs for a number of
steps on 2 gloo processes, and rank 0 reports the median step. The cluster is this machine as
`partita calibrate --nproc 2` measures it, first. What is compared is the ratio skewed / balanced,
predicted and measured: whether routing moves the step the way the price says, and by how much.

Run: ``.venv/bin/python benchmarks/expert_load.py [--rounds R]`` (default 2). Results: README,
"Measured".
"""

from __future__ import annotations

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

BATCH, SEQ, VOCAB, HIDDEN, STEPS, WARMUP = 8, 128, 512, 256, 8, 2


def model(skewed: bool):
    import transformers as tf

    from examples.models import LogitsOnly

    torch.manual_seed(0)
    m = LogitsOnly(tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, use_cache=False)))
    if skewed:
        with torch.no_grad():
            m.model.model.embed_tokens.weight[:, 0] += 20.0  # every token leans on dimension 0 ...
            for layer in m.model.model.layers:
                layer.mlp.gate.weight.zero_()
                layer.mlp.gate.weight[2:, 0] = 10.0  # ... which only experts 2 and 3 (rank 1 of ep = 2) read
    return m


def worker(plan_path: str, skewed: str, out: str) -> None:
    import partita

    m = partita.parallelize(model(skewed == "1"), plan=plan_path)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(WARMUP + STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        t0 = time.perf_counter()
        m.train_step(x[:, :-1], targets=x[:, 1:])
        times.append(time.perf_counter() - t0)
    if m.ctx.rank == 0:
        Path(out).write_text(json.dumps(times[WARMUP:]))


def plan_for(skewed: bool, folder: Path, cluster):
    from partita.compiler.compile import compile_model
    from partita.core.experts import router_profile
    from partita.core.options import Options
    from partita.runtime.experts import measure_routing

    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    counts = measure_routing(model(skewed), (x,))
    profile = folder / f"router-{int(skewed)}.json"
    profile.write_text(json.dumps(router_profile(counts, tokens=BATCH * SEQ, model="mixtral-bench",
                                                 layers=[str(i) for i in range(len(counts))])))
    return compile_model(lambda: model(skewed), Options(inputs=[f"input_ids=int64[{BATCH},{SEQ}]"], cluster=cluster,
                                                        devices=2, dp=2, ep=2, expert_load=str(profile)),
                         name="mixtral-bench").plan, counts


def run(plan, skewed: bool, folder: Path) -> float:
    from partita.runtime.processes.launch import run_torchrun

    path = plan.save(folder / f"plan-{int(skewed)}.json")
    out = folder / f"times-{int(skewed)}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rc = run_torchrun(2, [__file__, "--worker", str(path), str(int(skewed)), str(out)], env=env)
    if rc:
        raise SystemExit(f"the 2-process run failed ({rc})")
    return statistics.median(json.loads(out.read_text()))


def main(rounds: int) -> None:
    from rich.console import Console
    from rich.table import Table

    measured: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        from partita.compiler.commands.calibrate import calibrated_cluster
        from partita.runtime.calibrate import calibrate

        cluster = calibrated_cluster(calibrate(2))  # this machine, as `partita calibrate --nproc 2` measures it
        plans = {s: plan_for(s, folder, cluster) for s in (False, True)}
        for _ in range(rounds):
            for s in (False, True):
                measured[s].append(run(plans[s][0], s, folder))
    t = Table(title="routing: balanced against skewed, dp = 2 x ep = 2 on 2 gloo processes", title_justify="left")
    for col in ("router", "rows per expert (layer 0)", "load priced", "predicted step", "measured step (median)"):
        t.add_column(col)
    for s in (False, True):
        plan, counts = plans[s]
        t.add_row("skewed" if s else "as initialised", str(counts[0]), f"{plan.training.expert_load:.2f}x",
                  f"{plan.predicted.step_time_s * 1e3:.1f} ms",
                  f"{statistics.median(measured[s]) * 1e3:.1f} ms ({', '.join(f'{x * 1e3:.0f}' for x in measured[s])})")
    predicted = plans[True][0].predicted.step_time_s / plans[False][0].predicted.step_time_s
    real = statistics.median(measured[True]) / statistics.median(measured[False])
    Console().print(t)
    Console().print(f"skewed / balanced: predicted {predicted:.2f}x, measured {real:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main(int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2)
