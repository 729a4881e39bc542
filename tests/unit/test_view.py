"""`partita view`: the HTML page, opened in a real headless Chromium, shows the plan's own numbers.

Browser tests need Debian's chromium (/usr/bin/chromium) and the playwright Python package; they are
skipped, saying which is missing, without them. Everything else (timeline, memory split, trace checks,
page size, the click command) runs without a browser.
"""

import json

import pytest
from click.testing import CliRunner

from partita.compiler.timeline import measured_timeline, predicted_timeline
from partita.compiler.view import load_trace, render_html, stage_memory, view_command
from partita.core.errors import PlanError
from partita.core.options import Options
from partita.core.schedule import stage_order
from tests.synthetic_plans import llama70b_plan, small_plan

# -- plans ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_plan():
    """The plan `partita demo` makes: examples/models.py:gpt_tiny on 4 local processes (data parallel)."""
    from partita.compiler.compile import compile_model
    from partita.compiler.demo import BATCH, SEQ, demo_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    return compile_model(demo_model,
                         Options(inputs=[parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")],
                                 cluster=load_cluster("local", devices=4), world_size=4), name="gpt_tiny (demo)").plan


@pytest.fixture(scope="module")
def tp_pp_plan():
    return small_plan()


def trace_of(plan, *, slowdown=1.25, fingerprint=None):
    """A measured trace as the pipeline runtime writes it: the predicted slots, slower, on every rank."""
    events = []
    for s, kind, mb, t0, t1, _ in predicted_timeline(plan).to_dict()["slots"]:
        for rank in plan.stages[s].ranks:
            events.append({"name": f"{'FB'[kind]}{mb}", "cat": ("forward", "backward")[kind], "ph": "X",
                           "ts": 1000 + t0 * slowdown * 1e6, "dur": (t1 - t0) * slowdown * 1e6, "pid": rank, "tid": s,
                           "args": {"stage": s, "microbatch": mb, "rank": rank}})
    events.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}})
    return {"traceEvents": events,
            "metadata": {"fingerprint": fingerprint or plan.model.fingerprint, "mesh": plan.mesh.__dict__}}


# -- without a browser ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_timeline_has_the_textbook_bubble(tp_pp_plan, schedule):
    """Equal stages: step = (M + S - 1)(F + B); stage 0 idles (S - 1)/(M + S - 1) of it."""
    import dataclasses

    S, M, F, B = 4, 8, 0.01, 0.02
    stages = tuple(dataclasses.replace(tp_pp_plan.stages[0], index=s, forward_s=F, backward_s=B) for s in range(S))
    plan = dataclasses.replace(tp_pp_plan, stages=stages, mesh=dataclasses.replace(tp_pp_plan.mesh, pp=S, dp=1),
                               training=dataclasses.replace(tp_pp_plan.training, schedule=schedule,
                                                            grad_accum_steps=M, global_batch=M))
    t = predicted_timeline(plan)
    assert t.makespan == pytest.approx((M + S - 1) * (F + B))
    assert t.bubble_fraction(0) == pytest.approx((S - 1) / (M + S - 1))
    for s in range(S):
        kinds = [x.kind for x in t.slots if x.stage == s]
        assert kinds.count("forward") == M and kinds.count("backward") == M
    if schedule == "1f1b":  # stage 0 warms up with S - 1 forwards, then alternates
        assert stage_order("1f1b", 0, S, M)[:S + 1] == [("forward", 0), ("forward", 1), ("forward", 2),
                                                       ("forward", 3), ("backward", 0)]


def test_one_stage_accumulates_forward_then_backward(demo_plan):
    t = predicted_timeline(demo_plan)
    st, M = demo_plan.stages[0], demo_plan.training.grad_accum_steps
    assert t.stages == 1 and len(t.slots) == 2 * M
    assert t.makespan == pytest.approx(M * (st.forward_s + st.backward_s))


def test_stage_memory_is_exact_for_the_most_loaded_stage(tp_pp_plan):
    rows = stage_memory(tp_pp_plan)
    m = tp_pp_plan.predicted.memory
    assert [r["total"] for r in rows] == [s.memory_bytes for s in tp_pp_plan.stages]
    exact = [r for r in rows if r["exact"]]
    assert len(exact) == 1 and (exact[0]["params"], exact[0]["activations"]) == (m.params, m.activations)
    assert all(r["params"] + r["grads"] + r["optimizer"] + r["activations"] == r["total"] for r in rows)


def test_load_trace_names_what_is_wrong(tmp_path, tp_pp_plan):
    good = trace_of(tp_pp_plan)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(good))
    assert load_trace(path)["traceEvents"]

    bad = json.loads(json.dumps(good))
    bad["traceEvents"][3]["cat"] = "optimizer"
    cases = {"{nope": "JSON error at line 1", json.dumps({"events": []}): 'a "traceEvents" list',
             json.dumps(bad): "traceEvents[3]", json.dumps({"traceEvents": []}): "no forward or backward spans"}
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_trace(path)
    with pytest.raises(PlanError, match="cannot read trace file"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(PlanError, match="recorded for graph fingerprint 0000"):
        measured_timeline(trace_of(tp_pp_plan, fingerprint="0000000000000000"), tp_pp_plan)


def test_measured_timeline_takes_one_rank_per_stage(tp_pp_plan):
    t = measured_timeline(trace_of(tp_pp_plan, slowdown=1.25), tp_pp_plan)
    assert t.makespan == pytest.approx(1.25 * predicted_timeline(tp_pp_plan).makespan)
    assert len(t.slots) == 2 * tp_pp_plan.training.grad_accum_steps * len(tp_pp_plan.stages)
    assert "stage 1: rank 4" in t.source


def test_a_70b_plan_is_small_enough_to_mail():
    plan = llama70b_plan(validate=False)
    assert len(plan.nodes) > 5_800 and sum(len(n.ins) for n in plan.nodes) > 11_000 and len(plan.params) == 723
    html = render_html(plan)
    assert len(html) < 1_000_000, f"{len(html):,} bytes"
    # offline: nothing is fetched; the only URL is the SVG namespace
    assert "<script src" not in html and "<link" not in html and "https://" not in html


def test_view_command_writes_the_page_beside_the_plan(tmp_path, tp_pp_plan, monkeypatch):
    plan_path = tp_pp_plan.save(tmp_path / "llama.plan.json")
    opened = []
    monkeypatch.setattr("webbrowser.open", opened.append)
    r = CliRunner().invoke(view_command, [str(plan_path), "--open"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "llama.plan.html"
    assert out.is_file() and opened == [out.resolve().as_uri()] and "plan view written to" in r.output

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(trace_of(tp_pp_plan)))
    base = small_plan(dp=4, tp=1).save(tmp_path / "base.plan.json")
    r = CliRunner().invoke(view_command, [str(plan_path), "-o", str(tmp_path / "x.html"), "--against", str(base),
                                          "--trace", str(trace)])
    assert r.exit_code == 0, r.output and (tmp_path / "x.html").is_file()

    trace.write_text(json.dumps({"traceEvents": "no"}))
    r = CliRunner().invoke(view_command, [str(plan_path), "--trace", str(trace)])
    assert isinstance(r.exception, PlanError) and "not a pipeline trace" in r.exception.message


def _interleaved(plan):
    """``plan``'s two stages cut in two chunks each: virtual stage c on pipeline rank c mod 2, each
    half its stage's work, run by interleaved 1F1B."""
    import dataclasses

    base = plan.stages
    stages = tuple(dataclasses.replace(base[c // 2], index=c, forward_s=base[c // 2].forward_s / 2,
                                       backward_s=base[c // 2].backward_s / 2, ranks=base[c % 2].ranks)
                   for c in range(4))
    training = dataclasses.replace(plan.training, schedule="interleaved-1f1b", chunks=2)
    return dataclasses.replace(plan, stages=stages, training=training)


def test_interleaved_timeline_draws_ranks_running_their_virtual_stages(tp_pp_plan):
    """One row per pipeline rank, each running its two chunks; with the same work per rank the
    bubble shrinks from (p - 1) slots to (p - 1) / v."""
    plan, M = _interleaved(tp_pp_plan), tp_pp_plan.training.grad_accum_steps
    one, two = predicted_timeline(tp_pp_plan), predicted_timeline(plan)
    assert (two.stages, two.chunks) == (2, 2)
    assert {(s.stage, s.chunk) for s in two.slots} == {(0, 0), (0, 2), (1, 1), (1, 3)}
    assert len(two.slots) == 2 * M * 4
    slot = max(s.forward_s + s.backward_s for s in tp_pp_plan.stages)
    assert M * slot < two.makespan < one.makespan, (M * slot, two.makespan, one.makespan)
    assert two.to_dict()["chunks"] == 2 and {row[5] for row in two.to_dict()["slots"]} == {0, 1, 2, 3}


def test_unsolved_alternatives_show_no_memory_in_the_report():
    """`partita show`'s alternatives: a candidate branch and bound left unsolved says "-" for its memory,
    not "0 B" (issue 45); solved ones keep their figure."""
    from rich.console import Console

    from partita.compiler.report import alternatives_table
    from partita.core.plans.plan import Plan
    from tests.unit.test_verify_axes import golden

    plan = Plan.from_dict(golden("hf-llama-1b-a100x16"))
    console = Console(width=400, record=True)
    console.print(alternatives_table(plan))
    import re

    text = console.export_text()
    unsolved = [a for a in plan.alternatives if not a.fits and a.step_time_s is None and not a.memory_bytes]
    assert unsolved and " 0 B " not in text
    # step time and memory both "-": the unsolved rows, and only those
    assert len(re.findall(r"│ -\s+│ -\s+│", text)) == len(unsolved), text
