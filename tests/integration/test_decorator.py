"""The decorator path end to end on gloo ranks: the planner's plans (dp, tp, pp, ZeRO, recomputation)
given to the decorated script as `partita run` gives them; tests/unit/test_decorator.py has the
one-process checks, tests/integration/test_decorator_launchers.py torchrun and `partita run` themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import WORKERS, calls, fast_cluster, launch
from tests.unit.test_decorator import ref  # noqa: F401 (fixtures)
from tests.workers import decorator_script as script


def check(out: Path, ref, world: int, mesh: tuple[int, int, int] | None = None) -> None:
    data = json.loads(out.read_text())
    ref_losses, ref_state = ref
    mesh = mesh or (world, 1, 1)
    assert data["world_size"] == world and data["mesh"] == list(mesh)
    assert data["grad_accum_steps"] == 2  # pinned on the decorator
    assert data["micro_batch_size"] * 2 * mesh[0] == script.BATCH
    assert data["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    state = torch.load(out.with_suffix(".pt"), weights_only=True)  # gathered from every rank's part
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    # every collective the rank ran is in the plan's prediction, with the same bytes and count
    assert any(c[1] == "dp" and c[2] > 4 for c in data["counted"])  # gradients (or ZeRO shards) crossed dp
    assert calls(data["counted"]) == calls(data["planned"])


def compile_and_launch(tmp_path: Path, cli, *compile_args: str, trace: Path | None = None) -> tuple[Path, Path]:
    """`partita compile` (in this process) the script's model with ``compile_args``, then the
    script's ``run_plan`` on 4 ranks of the harness's group, given the plan (and ``trace``) as `partita
    run` gives them (the launcher itself: tests/integration/test_decorator_launchers.py)."""
    plan, out = tmp_path / "plan.json", tmp_path / "out.json"
    code, _, err = cli("compile", f"{WORKERS / 'decorator_script.py'}:make_model", *compile_args,
                       "--grad-accum-steps", "2", "-o", plan)
    assert code == 0, err
    launch(4, script.run_plan, str(plan), str(out), str(trace) if trace else None)
    return plan, out


def counted_kinds(out: Path) -> set[tuple[str, str]]:
    return {(c[0], c[1]) for c in json.loads(out.read_text())["counted"]}


def held_matches_the_plan(out: Path, dp: int) -> None:
    """The model state ZeRO holds on rank 0 is the plan's prediction, up to the padding (at most
    dp - 1 elements of 16 bytes per bucket) and AdamW's 4-byte step counter per shard."""
    data = json.loads(out.read_text())
    held, n = sum(data["held"].values()), data["buckets"]
    assert 0 <= held - sum(data["predicted_state"]) <= 16 * (dp - 1) * n + 4 * n, (
        data["held"], data["predicted_state"])


def test_the_planners_tensor_parallel_plan(tmp_path, cli, ref):
    """The planner's own dp=2 x tp=2 plan (not a hand-built one), run by the runtime: same training."""
    _, out = compile_and_launch(tmp_path, cli, "--cluster", fast_cluster(tmp_path), "--tp", "2")
    check(out, ref, 4, mesh=(2, 2, 1))
    assert any(axis == "tp" for _, axis in counted_kinds(out))  # tensor-parallel collectives ran, as planned
def test_the_planners_pipeline_plan(tmp_path, cli, ref):
    """The planner's own dp=2 x pp=2 1F1B plan, run by the runtime: same training as one process, and
    rank 0 (stage 0) runs exactly its stage's planned collectives and sends."""
    trace = tmp_path / "trace.json"
    plan, out = compile_and_launch(tmp_path, cli, "--devices", "4", "--pp", "2", trace=trace)
    check(out, ref, 4, mesh=(2, 1, 2))
    assert ("send_recv", "pp") in counted_kinds(out)
    # the measured schedule: every rank's forward and backward of every micro-batch of every step
    from partita.compiler.view import load_trace, render_html
    from partita.core.plans.verify import load_plan

    events = load_trace(trace)["traceEvents"]
    assert len([e for e in events if e["cat"] == "forward"]) == 4 * script.STEPS * 2
    assert {e["tid"] for e in events} == {0, 1}
    assert "measured" in render_html(load_plan(plan), trace=load_trace(trace))
def test_planned_zero2_with_tensor_parallelism(tmp_path, cli, ref):
    """ZeRO-2 over dp=2 of the planner's dp=2 x tp=2 plan: same training as one process."""
    _, out = compile_and_launch(tmp_path, cli, "--cluster", fast_cluster(tmp_path), "--tp", "2", "--zero", "2")
    check(out, ref, 4, mesh=(2, 2, 1))
    kinds = counted_kinds(out)
    assert {("reduce_scatter", "dp"), ("all_gather", "dp")} <= kinds and any(a == "tp" for _, a in kinds)
@pytest.mark.parametrize("zero", [1, 3])
def test_planned_zero_inside_a_pipeline(tmp_path, cli, ref, zero):
    """ZeRO over dp=2 of the planner's dp=2 x pp=2 1F1B plan: same training as one process, and
    stage 0's reduce-scatters, all-gathers and sends ran exactly as the plan lists them."""
    _, out = compile_and_launch(tmp_path, cli, "--devices", "4", "--pp", "2", "--zero", str(zero))
    check(out, ref, 4, mesh=(2, 1, 2))
    assert {("reduce_scatter", "dp"), ("all_gather", "dp"), ("send_recv", "pp")} <= counted_kinds(out)
def test_planned_zero3_with_tensor_parallelism(tmp_path, cli, ref):
    """ZeRO-3 over dp=2 of the planner's dp=2 x tp=2 plan: parameters gathered per graph node."""
    _, out = compile_and_launch(tmp_path, cli, "--cluster", fast_cluster(tmp_path), "--tp", "2", "--zero", "3")
    check(out, ref, 4, mesh=(2, 2, 1))
    held_matches_the_plan(out, 2)
    kinds = counted_kinds(out)
    assert {("reduce_scatter", "dp"), ("all_gather", "dp")} <= kinds and any(a == "tp" for _, a in kinds)
def test_planned_a_recomputing_tensor_parallel_plan(tmp_path, cli, ref):
    """`--recompute full` on the planner's dp=2 x tp=2 plan: every layer reruns its forward in backward.
    Same training as one process, and the TP collectives the recompute repeats are in the plan's
    list (check compares every collective, call for call)."""
    plan, out = compile_and_launch(tmp_path, cli, "--cluster", fast_cluster(tmp_path), "--tp", "2",
                                   "--recompute", "full")
    check(out, ref, 4, mesh=(2, 2, 1))
    from partita.core.plans.verify import load_plan

    p = load_plan(plan)
    assert all(s.recompute == "full" for s in p.stages)
    assert any("again when the layer is recomputed" in c.purpose for c in p.collectives)
@pytest.mark.parametrize("zero", [1, 3])
def test_planned_a_zero_plan(tmp_path, cli, ref, zero):
    """The planner's ZeRO plans (pinned stage) on 4 processes: same training as one process, and the
    reduce-scatters / all-gathers ran exactly as the plan lists them. Pure data parallelism is pinned
    (--tp 1 --pp 1): on the uncalibrated local preset ZeRO-3's priced traffic can make a smaller dp group
    the faster plan."""
    _, out = compile_and_launch(tmp_path, cli, "--devices", "4", "--zero", str(zero), "--tp", "1", "--pp", "1")
    check(out, ref, 4)
    held_matches_the_plan(out, 4)
    assert {("reduce_scatter", "dp"), ("all_gather", "dp")} <= counted_kinds(out)
