"""`partita view`: the HTML page, opened in a real headless Chromium, shows the plan's own numbers.

Browser tests need Debian's chromium (/usr/bin/chromium) and the playwright Python package; they are
skipped, saying which is missing, without them. Everything else (timeline, memory split, trace checks,
page size, the click command) runs without a browser.
"""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from partita.compiler.report import fmt_bytes, fmt_time
from partita.compiler.timeline import measured_timeline, predicted_timeline
from partita.compiler.view import load_trace, render_html, stage_memory, view_command
from partita.core.errors import PlanError
from partita.core.options import Options
from partita.core.schedule import stage_order
from tests.synthetic_plans import gpt3_175b_plan, llama70b_plan, small_plan

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


# -- plans ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_plan():
    """The plan `partita demo` makes: examples/models.py:gpt_tiny on 4 local processes (data parallel)."""
    from partita.compiler.compile import compile_model
    from partita.compiler.demo import BATCH, SEQ, demo_model
    from partita.core.cluster import load_cluster
    from partita.core.inputs import parse_input_spec

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


# -- in a browser -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need `pip install playwright`")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need Chromium at {CHROMIUM}: `apt-get install -y chromium`")
    profile = tempfile.mkdtemp(prefix="partita-chromium-")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                        headless=True, viewport={"width": 1400, "height": 1000})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def open_page(browser, tmp_path):
    """Write the page to a file, open it offline, wait for it to draw; fail on any console error or request."""
    opened = []

    def open_(html: str):
        path = tmp_path / f"page{len(opened)}.html"
        path.write_text(html)
        page = browser.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url}"))
        page.on("request", lambda r: None if r.url.startswith(("file://", "data:", "blob:")) else
                problems.append(f"network request: {r.url}"))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready]", timeout=15_000)
        assert page.get_attribute("body", "data-ready") == "1", page.text_content("#app")
        opened.append((page, problems))
        return page

    yield open_
    for page, problems in opened:
        assert problems == []
        page.close()


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
