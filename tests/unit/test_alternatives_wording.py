"""The alternatives a plan records say what they mean (issue 45): no row is faster than the chosen one
without a word why, and the chosen row does not call itself the fastest when an unweighed row is."""

from __future__ import annotations

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.workers import tied_script as script


def test_an_unweighed_zero_row_faster_than_the_chosen_one_says_so_and_how_to_plan_it():
    # dp=2 on CPU processes: ZeRO-1's sharded optimizer step outweighs its equal traffic at this layout
    plan = compile_model(script.build("tied-gpt"), Options(
        inputs=[parse_input_spec(f"idx=int64[8,{script.SEQ}]")], cluster=load_cluster("local", devices=2),
        world_size=2, dp=2)).plan
    chosen = next(a for a in plan.alternatives if a.chosen)
    faster = [a for a in plan.alternatives if a.step_time_s is not None and a.step_time_s < chosen.step_time_s]
    assert faster, "the case needs an unweighed ZeRO row predicted faster than the chosen one"
    for a in faster:
        assert a.reason.startswith(f"faster here but not weighed (pin --zero {a.zero_stage} to plan it)"), a.reason
    quickest = min(faster, key=lambda a: a.step_time_s)
    assert chosen.reason == (
        f"chosen: fastest predicted step that fits of those weighed; ZeRO-{quickest.zero_stage} at this layout is "
        f"predicted {quickest.step_time_s / chosen.step_time_s:.2f}x (its sharded optimizer step), not weighed: pin "
        f"--zero {quickest.zero_stage} to plan it"), chosen.reason
    # and pinned, that stage is planned: its step is the one the row priced at this layout
    pinned = compile_model(script.build("tied-gpt"), Options(
        inputs=[parse_input_spec(f"idx=int64[8,{script.SEQ}]")], cluster=load_cluster("local", devices=2),
        world_size=2, dp=2, zero=quickest.zero_stage, micro_batch_size=chosen.micro_batch_size)).plan
    assert pinned.training.zero_stage == quickest.zero_stage
    assert abs(pinned.predicted.step_time_s - quickest.step_time_s) <= 0.02 * quickest.step_time_s, (
        pinned.predicted.step_time_s, quickest.step_time_s)
