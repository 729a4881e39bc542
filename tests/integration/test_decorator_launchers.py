"""The decorator under the launchers themselves: torchrun (rank 0 plans, the others receive the plan)
and `partita run PLAN.json` (the plan from a file, the console script as a user starts it). The
planner's other plans run on the harness's ranks: tests/integration/test_decorator.py."""

from __future__ import annotations

from pathlib import Path

from tests.harness import WORKERS, partita_cli, torchrun
from tests.integration.test_decorator import check
from tests.unit.test_decorator import ref  # noqa: F401 (fixtures)


def compile_and_run(tmp_path: Path, *compile_args: str) -> tuple[Path, Path]:
    """`partita compile` the script's model with ``compile_args``, then `partita run` the plan (both as
    console scripts, as a user runs them)."""
    plan, out = tmp_path / "plan.json", tmp_path / "out.json"
    partita_cli("compile", f"{WORKERS / 'decorator_script.py'}:make_model", *compile_args, "--grad-accum-steps", "2",
                "-o", plan)
    partita_cli("run", plan, WORKERS / "decorator_script.py", out)
    return plan, out


def test_under_torchrun_rank0_plans_and_ranks_match_one_process(tmp_path, ref):
    out = tmp_path / "torchrun.json"
    torchrun(WORKERS / "decorator_script.py", out, nproc=2)
    check(out, ref, 2)


def test_partita_run_with_a_plan_file(tmp_path, ref):
    _, out = compile_and_run(tmp_path, "--devices", "4")
    check(out, ref, 4)
