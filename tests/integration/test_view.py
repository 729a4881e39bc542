"""`partita view`: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_view.py has the one-process checks."""

from __future__ import annotations

from partita.compiler.report import fmt_bytes, fmt_time
from partita.compiler.timeline import predicted_timeline
from partita.compiler.view import render_html
from tests.synthetic_plans import gpt3_175b_plan, small_plan
from tests.unit.test_view import _interleaved, demo_plan, tp_pp_plan, trace_of  # noqa: F401 (fixtures)


def hover_line(page, selector):
    """Move the mouse onto the middle of an SVG path (its bounding box's centre may be off the curve)."""
    page.locator(selector).scroll_into_view_if_needed()
    x, y = page.eval_on_selector(selector, """p => {
        const q = p.getPointAtLength(p.getTotalLength() / 2), m = p.getScreenCTM();
        return [q.x * m.a + q.y * m.c + m.e, q.x * m.b + q.y * m.d + m.f]; }""")
    page.mouse.move(x, y)


def texts(page, selector):
    return page.eval_on_selector_all(selector, "els => els.map(e => e.textContent)")


def test_demo_plan_page(open_page, demo_plan, tmp_path):
    page = open_page(render_html(demo_plan))
    p = demo_plan.predicted
    field = lambda k: page.text_content(f'[data-field="{k}"]')
    assert field("step") == fmt_time(p.step_time_s)
    assert field("mesh").startswith(str(demo_plan.mesh))
    assert field("mfu") == f"{p.mfu:.1%}" and field("samples") == f"{p.samples_per_s:,.1f}"
    assert field("tokens") == f"{p.tokens_per_s:,.0f}" and field("zero") == "stage 0"
    assert field("solver").startswith(demo_plan.solver.method)
    # one card per axis of the registry (core/axes), in its order, each off or what the plan decided
    from partita.core.axes import AXES, axis_summary

    assert page.eval_on_selector_all("#axes .axis", "es => es.map(e => e.dataset.axis)") == [a.name for a in AXES]
    for name, decided in axis_summary(demo_plan):
        card = page.locator(f'#axes .axis[data-axis="{name}"]')
        assert card.locator("span").text_content() == (decided or "off")
        assert card.get_attribute("class") == ("axis on" if decided else "axis off")
    # CPU processes are called processes, not GPUs (issue 45)
    assert "4 of 4 processes" in page.text_content("#mesh .note") and "GPU" not in page.text_content("#mesh")
    assert page.locator("g.device").count() == demo_plan.world_size
    # memory: the exact breakdown of the one stage
    cells = {k: page.text_content(f'.mem-table tr[data-stage="0"] td[data-kind="{k}"]')
             for k in ("params", "grads", "optimizer", "activations", "total")}
    assert cells == {"params": fmt_bytes(p.memory.params), "grads": fmt_bytes(p.memory.grads),
                     "optimizer": fmt_bytes(p.memory.optimizer), "activations": fmt_bytes(p.memory.activations),
                     "total": fmt_bytes(p.memory.total)}
    # expanding a decoder layer lists exactly the plan's nodes of that layer, in order
    first_layer = page.locator("g.module.layer").first
    key = first_layer.get_attribute("data-group")
    first_layer.locator(".head").click()
    rows = page.eval_on_selector_all(f'g.module[data-group="{key}"] g.op', "es => es.map(e => e.dataset.node)")
    assert rows and rows == [n.name for n in demo_plan.nodes if n.layer == key]
    assert page.locator("g.slot").count() == 2 * demo_plan.training.grad_accum_steps
    page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
    assert (tmp_path / "demo.png").stat().st_size > 20_000


def test_tp_pp_plan_page_with_trace_and_baseline(open_page, tp_pp_plan):
    import dataclasses

    plan = tp_pp_plan
    # the baseline: o_proj of layer 1 replicated instead of row-parallel, on another mesh
    base_params = tuple(dataclasses.replace(q, layout={**q.layout, "tp": "replicate"})
                        if q.name == "model.layers.1.self_attn.o_proj.weight" else q for q in plan.params)
    base = dataclasses.replace(small_plan(dp=4, tp=1, validate=False), params=base_params)
    page = open_page(render_html(plan, against=base, trace=trace_of(plan)))

    # mesh: every rank coloured by its stage, one outline per TP group
    stages = dict(zip(map(int, page.eval_on_selector_all("g.device", "es => es.map(e => e.dataset.rank)")),
                      map(int, page.eval_on_selector_all("g.device", "es => es.map(e => e.dataset.stage)"))))
    assert stages == {r: s.index for s in plan.stages for r in s.ranks}
    assert page.locator("rect.tp-group").count() == plan.world_size // plan.mesh.tp

    # graph: one box per decoder layer with its splits; expanding shows its ops with their strategies
    layers = page.eval_on_selector_all("g.module.layer", "es => es.map(e => e.dataset.group)")
    assert layers == [f"model.layers.{i}" for i in range(4)]
    assert page.locator('g.module[data-group="model.layers.1"] .head [data-split="col"]').text_content() == "col ×5"
    page.locator('g.module[data-group="model.layers.1"] .head').click()
    ops = [n for n in plan.nodes if n.layer == "model.layers.1"]
    assert texts(page, 'g.module[data-group="model.layers.1"] g.op .opname') == [n.name for n in ops]  # short names
    o_proj = next(n for n in ops if n.module.endswith("o_proj"))
    assert page.locator(f'g.op[data-node="{o_proj.name}"] .chip').text_content() == "row"

    # hovering the edge of the row-parallel output into the residual add shows its all-reduce and bytes
    add = next(n for n in ops if any(e.src == o_proj.name for e in n.ins))
    edge = next(e for e in add.ins if e.src == o_proj.name)
    hover_line(page, f'g.op-edge[data-from="{o_proj.name}"][data-to="{add.name}"] .hit')
    tip = page.text_content("#tooltip")
    assert "forward all_reduce" in tip and fmt_bytes(edge.bytes) in tip and "partial -> replicate" in tip
    assert page.is_visible("#tooltip")

    # memory bars: each stage's total per device, against capacity
    totals = texts(page, "g.mem-bar .mem-total")
    assert [t.split(" (")[0] for t in totals] == [fmt_bytes(s.memory_bytes) for s in plan.stages]
    assert fmt_bytes(plan.predicted.memory.capacity) in page.text_content(".capacity-text")

    # schedule: every micro-batch's forward and backward on each stage, the predicted bubble, the measured run
    pred = predicted_timeline(plan)
    M, S = plan.training.grad_accum_steps, len(plan.stages)
    assert page.locator("svg.predicted g.slot.fwd").count() == M * S
    assert page.locator("svg.predicted g.slot.bwd").count() == M * S
    assert texts(page, "svg.predicted .bubble-text") == [f"bubble {pred.bubble_fraction(s):.1%}" for s in range(S)]
    assert fmt_time(pred.makespan) in page.text_content("svg.predicted .tl-title")
    measured = page.text_content("svg.measured .tl-title")
    assert "1.25x predicted" in measured and fmt_time(1.25 * pred.makespan) in measured

    # against the baseline: the mesh and the module whose split changed are highlighted
    assert "changed" in page.get_attribute('.fact:has([data-field="mesh"])', "class")
    changed = page.eval_on_selector_all("g.module.changed", "es => es.map(e => e.dataset.group)")
    assert changed == ["model.layers.1"]
    assert "model.layers.1.self_attn.o_proj.weight" in page.text_content("table.diff-layouts")
    assert "dp=4 x tp=1 x pp=2" in page.text_content("#diff-summary")

    # alternatives: every candidate, the chosen one marked
    assert page.locator("table.alts tbody tr").count() == len(plan.alternatives)
    assert page.text_content("table.alts tr.chosen td:last-child") == plan.alternatives[0].reason


def test_gpt3_175b_on_128_gpus_page(open_page, tmp_path):
    plan = gpt3_175b_plan(validate=False)
    page = open_page(render_html(plan))
    assert page.locator("g.device").count() == 128 and page.locator("rect.tp-group").count() == 16
    assert page.locator("g.module.layer").count() == 96
    assert page.locator("svg.predicted g.slot").count() == 2 * 32 * 8
    assert page.text_content('[data-field="schedule"]') == "1f1b"
    assert "128 of 128 GPUs" in page.text_content("#mesh .note")
    page.screenshot(path=str(tmp_path / "gpt3.png"), full_page=True)
    assert (tmp_path / "gpt3.png").stat().st_size > 50_000


def test_a_recomputing_stage_is_marked(open_page, tp_pp_plan):
    """The header says which stages recompute their activations, and so does their memory bar."""
    import dataclasses

    modes = {0: "full", 1: "selective"}
    stages = tuple(dataclasses.replace(s, recompute=modes.get(s.index, "none")) for s in tp_pp_plan.stages)
    assert len(stages) == 2
    page = open_page(render_html(dataclasses.replace(tp_pp_plan, stages=stages)))
    assert page.text_content('[data-field="recompute"]') == "whole layers on stage(s) 0; attention cores on stage(s) 1"
    labels = texts(page, "g.mem-bar text.axis")
    assert [t.partition(" · recomputes ")[2] or "none" for t in labels] == [s.recompute for s in stages], labels
    page = open_page(render_html(tp_pp_plan))
    assert page.text_content('[data-field="recompute"]') == "none"


def test_offloaded_state_is_shown(open_page, tp_pp_plan):
    """The header says where the optimizer's state lives and how much of it is in host memory; each
    memory bar says its state is on the host."""
    import dataclasses

    assert open_page(render_html(tp_pp_plan)).text_content('[data-field="offload"]') == "on the device"
    predicted = dataclasses.replace(tp_pp_plan.predicted,
                                    memory=dataclasses.replace(tp_pp_plan.predicted.memory, host=3_000_000_000))
    plan = dataclasses.replace(tp_pp_plan, training=dataclasses.replace(tp_pp_plan.training, offload="optimizer"),
                               predicted=predicted)
    page = open_page(render_html(plan))
    assert page.text_content('[data-field="offload"]') == "in host memory, stepped by the host: 3.00 GB per device"
    labels = texts(page, "g.mem-bar text.axis")
    assert labels and all(t.endswith(" · state on host") for t in labels), labels


def test_interleaved_schedule_page(open_page, tp_pp_plan):
    plan = _interleaved(tp_pp_plan)
    page = open_page(render_html(plan))
    M = plan.training.grad_accum_steps
    assert page.text_content('[data-field="schedule"]') == "interleaved-1f1b"
    assert "2 ranks of 2 virtual stages each" in page.text_content("#schedule-summary")
    assert texts(page, "svg.predicted text.axis")[:2] == ["rank 0", "rank 1"]
    assert page.locator("svg.predicted g.slot").count() == 2 * M * 4
    assert sorted({int(c) for c in page.locator("svg.predicted g.slot").evaluate_all(
        "gs => gs.map(g => g.getAttribute('data-chunk'))")}) == [0, 1, 2, 3]


def test_unsolved_alternatives_and_expert_collectives_are_worded(open_page):
    """A candidate branch and bound left unsolved shows "-" for its memory, not "0 B" (its reason says
    why); an expert-parallel plan counts its all-to-alls beside the collectives inserted on edges."""
    from partita.core.plans.plan import Plan
    from tests.unit.test_verify_axes import golden

    plan = Plan.from_dict(golden("mixtral-ep2"))
    page = open_page(render_html(plan))
    assert "expert all-to-all" in page.text_content("#graph .note")
    plan = Plan.from_dict(golden("hf-llama-1b-a100x16"))
    unsolved = [i for i, a in enumerate(plan.alternatives) if not a.fits and a.step_time_s is None
                and not a.memory_bytes]
    assert unsolved, "the golden plan keeps pruned candidates"
    page = open_page(render_html(plan))
    for i in unsolved:
        assert page.text_content(f'table.alts tr[data-index="{i}"] td:nth-child(6)') == "-"
    # the count the header gives (the solver's) is the one the alternatives' note names
    assert f"of the {plan.solver.candidates} candidates solved" in page.text_content("#alternatives .note")


def test_a_context_parallel_plan_shows_its_groups_and_strategy(open_page):
    """The cp card names the degree, the attention strategy and the cp groups (consecutive dp ranks,
    tp apart)."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.core.options import Options
    from tests.workers.cp_worker import gpt_cp

    plan = compile_model(gpt_cp, Options(inputs=[parse_input_spec("idx=int64[4,16]")],
                                         cluster=load_cluster("local", devices=4), world_size=4, cp=2,
                                         cp_attention="ring")).plan
    page = open_page(render_html(plan))
    card = page.text_content('#axes .axis[data-axis="context parallelism"]')
    tp = plan.mesh.tp
    groups = " ".join(f"[{r}, {r + tp}]" for r in sorted(g[0] for g in plan.mesh.groups("cp")))
    assert "cp = 2" in card and "attention by ring" in card and f"groups {groups}" in card, (card, plan.mesh)


def test_the_schedule_names_its_gap_to_the_plans_step_time(open_page):
    """The timeline's span and the header's step time are different sums: the page gives the step
    time's terms, which add up to it (on a plan the planner made), and the gap between the span and
    compute + bubble."""
    import re

    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.core.options import Options
    from tests.workers import tied_script as script

    plan = compile_model(script.build("tied-gpt"), Options(
        inputs=[parse_input_spec(f"idx=int64[8,{script.SEQ}]")], cluster=load_cluster("local", devices=2),
        world_size=2, pp=2, grad_accum_steps=4)).plan
    page = open_page(render_html(plan))
    text = page.text_content("#schedule-gap")
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

    def seconds(label):
        value, scale = re.search(rf"{label} ([0-9.]+) (us|ms|s)\b", text).groups()
        return float(value) * unit[scale]

    pr = plan.predicted
    terms = [seconds(t) for t in ("= compute", "pipeline bubble", "stage sends", "other exposed communication",
                                  "optimizer")]
    assert abs(seconds("The plan's step time") - pr.step_time_s) <= 0.005 * pr.step_time_s, text
    assert abs(sum(terms) - pr.step_time_s) <= 0.01 * pr.step_time_s, (terms, text)
    assert "differs from compute + bubble by" in text and "without the per-micro-batch overhead" in text, text
