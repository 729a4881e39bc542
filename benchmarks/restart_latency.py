"""Restart latency: from the SIGKILL of a rank to the end of the first step of the restarted run.

`partita run --max-restarts 1 --checkpoint-dir D --checkpoint-every 2` trains the tied GPT of
tests/workers/tied_script.py on a dp2 plan (two gloo processes); rank 1 SIGKILLs itself after step 3
(tests/workers/restart_script.py). The agent notices the dead rank, stops the other, restarts both; each
imports torch and partita again, builds the model, joins the process group, checks the newest
checkpoint's digests, loads it (step 2) and trains step 3 again. The latency is that step's end
time minus the kill's. Run: ``python benchmarks/restart_latency.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # tests/ and examples/ are not installed
    sys.path.insert(0, str(ROOT))


def once(plan: Path, folder: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    partita = str(Path(sys.executable).with_name("partita"))
    script = ROOT / "tests" / "workers" / "restart_script.py"
    subprocess.run([partita, "run", "--checkpoint-dir", str(folder / "ckpt"), "--checkpoint-every", "2",
                    "--max-restarts", "1", str(plan), str(script), str(folder), "3"],
                   env=env, check=True, capture_output=True)
    lines = [json.loads(x) for x in (folder / "losses.jsonl").read_text().splitlines()]
    return min(x["t"] for x in lines if x["attempt"] == 1) - float((folder / "killed_at").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.core.options import Options
    from tests.workers import tied_script as script

    with tempfile.TemporaryDirectory(prefix="partita-restart-") as tmp:
        plan = compile_model(script.build("tied-gpt"),
                             Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                     cluster=load_cluster("local", devices=2), world_size=2, dp=2)).plan
        path = plan.save(Path(tmp, "plan.json"))
        times = []
        for i in range(args.repeats):
            folder = Path(tmp, f"run{i}")
            folder.mkdir()
            times.append(once(path, folder))
            print(f"  run {i}: {times[-1]:.1f} s from the kill to the first resumed step", flush=True)
    print(f"restart latency, dp2 on 2 gloo processes: median {statistics.median(times):.1f} s "
          f"(min {min(times):.1f}, max {max(times):.1f}) over {args.repeats} runs")


if __name__ == "__main__":
    main()
