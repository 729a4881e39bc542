"""`partita view`: one self-contained HTML page that shows a plan.

The page is a single file that works offline and can be mailed: its script
and style (``view.js``, ``view.css`` beside this file) are inlined, and the
data is embedded once as gzip + base64 JSON that the page unpacks with the
browser's ``DecompressionStream`` and draws client-side (SVG, no library).
A 70B plan (~6,000 nodes) is a few hundred KB.

What is embedded: the plan (``Plan.to_dict()``), the predicted pipeline
timeline (``timeline.predicted_timeline``), the memory of each stage's
devices, the expert groups of an ep > 1 plan (``report.expert_layout``), each axis of the
registry and what the plan decided on it (core/axes ``axis_summary``: the axis cards),
and optionally a measured timeline (from a trace) and the diff from another
plan (``diff.diff_plans(against, plan)``: ``against`` is the baseline, the
page shows what this plan changes).
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import webbrowser
from pathlib import Path
from typing import Any

import click

from partita.compiler.diff import diff_plans
from partita.compiler.report import CALIBRATE_HINT, expert_layout, memory_terms, sources_of, tp_split, uncalibrated
from partita.compiler.timeline import load_trace, measured_timeline, predicted_timeline
from partita.core.axes import axis_summary
from partita.core.errors import printable
from partita.core.files import writable_path, write_text, writes
from partita.core.plans.plan import MemoryBreakdown, Plan
from partita.core.plans.verify import load_plan

__all__ = ["render_html", "load_trace", "stage_memory", "view_command"]

_HERE = Path(__file__).parent


def stage_memory(plan: Plan) -> list[dict[str, Any]]:
    """Bytes per device of each stage, split into params, grads, optimizer state and activations.

    The plan carries the full breakdown only for its most loaded device
    (``plan.predicted.memory``) and a total per stage (``Stage.memory_bytes``).
    The most loaded stage gets the exact breakdown; another stage's state
    (params, grads, optimizer) is the exact one scaled by its share of
    parameters, and its activations are the rest of its total, marked
    ``exact: False``.
    """
    m = plan.predicted.memory
    if not plan.stages:
        return [_memory_row(0, tuple(range(plan.world_size)), m, exact=True)]
    worst = max(plan.stages, key=lambda s: s.memory_bytes)
    rows = []
    for s in plan.stages:
        ranks = s.ranks or tuple(range(plan.world_size))
        if s is worst:
            rows.append(_memory_row(s.index, ranks, m, exact=True))
            continue
        scale = s.params / worst.params if worst.params else 1.0
        state = [m.params * scale, m.grads * scale, m.optimizer * scale]
        if sum(state) > s.memory_bytes:
            state = [x * s.memory_bytes / sum(state) for x in state]
        p, g, o = (int(round(x)) for x in state)
        rows.append(_memory_row(s.index, ranks, MemoryBreakdown(p, g, o, max(0, s.memory_bytes - p - g - o),
                                                                m.capacity), exact=False))
    return rows


def _memory_row(stage: int, ranks: tuple[int, ...], m: MemoryBreakdown, *, exact: bool) -> dict[str, Any]:
    """One stage's bar: the state, the saved activations, what the step's peak holds beyond them (the
    costliest op's transient and ZeRO's buffers, or the optimizer step's fp32 gradients where that
    side is larger) and the allocator's share (core/plans/plan.py ``MemoryBreakdown``)."""
    act = 0 if m.at_step else m.activations
    extra = m.step if m.at_step else m.transient + m.collectives
    return {"stage": stage, "ranks": list(ranks), "params": m.params, "grads": m.grads_at_peak,
            "optimizer": m.optimizer, "activations": act, "extra": extra, "allocator": m.allocator, "total": m.total,
            "capacity": m.capacity, "exact": exact}


def page_data(plan: Plan, *, against: Plan | None = None, trace: dict | None = None) -> dict[str, Any]:
    """Everything the page draws, as JSON-ready data."""
    return {
        "plan": plan.to_dict(),
        "timeline": predicted_timeline(plan).to_dict(),
        "measured": measured_timeline(trace, plan).to_dict() if trace is not None else None,
        "memory": stage_memory(plan),
        "memory_terms": memory_terms(plan.predicted.memory),
        "sources": sources_of(plan),
        "uncalibrated": CALIBRATE_HINT if uncalibrated(plan) else None,
        "tp_split": tp_split(plan),
        "experts": expert_layout(plan),
        "axes": [{"axis": name, "decided": decided} for name, decided in axis_summary(plan)],
        "diff": diff_plans(against, plan).to_dict() if against is not None else None,
        "against": None if against is None else {
            "name": against.model.name, "fingerprint": against.model.fingerprint, "mesh": str(against.mesh),
            "step_time_s": against.predicted.step_time_s},
    }


def render_html(plan: Plan, *, against: Plan | None = None, trace: dict | None = None) -> str:
    """The page for ``plan`` (compared with the baseline ``against``, beside the measured ``trace``)."""
    data = json.dumps(page_data(plan, against=against, trace=trace), separators=(",", ":"), allow_nan=False)
    packed = base64.b64encode(gzip.compress(data.encode(), compresslevel=9, mtime=0)).decode("ascii")
    title = f"partita plan: {plan.model.name} on {plan.cluster.get('name', '?')} ({plan.mesh})"
    return _TEMPLATE.format(
        title=html.escape(title),
        css=(_HERE / "view.css").read_text(),
        js=(_HERE / "view.js").read_text().replace("</script", "<\\/script"),
        data=packed,
    )


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; \
style-src 'unsafe-inline'; img-src data:; connect-src data: blob:">
<title>{title}</title>
<style>
{css}
</style>
</head>
<body>
<main id="app"><p id="loading">unpacking the plan...</p></main>
<div id="tooltip" role="tooltip" hidden></div>
<script id="partita-data" type="application/octet-stream">{data}</script>
<script>
{js}
</script>
</body>
</html>
"""


@click.command("view")
@click.argument("plan_path", metavar="PLAN.json")
@click.option("-o", "--output", metavar="PATH", default=None,
              help="the HTML file to write (default: PLAN.html beside the plan)")
@click.option("--open", "open_browser", is_flag=True, help="open the page in the default web browser")
@click.option("--against", "against_path", metavar="B.json", default=None,
              help="a baseline plan: highlight what PLAN changes from it")
@click.option("--trace", "trace_path", metavar="TRACE.json", default=None,
              help="a measured pipeline trace to draw beside the predicted schedule")
@writes("output")
def view_command(plan_path: str, output: str | None, open_browser: bool, against_path: str | None,
                 trace_path: str | None) -> None:
    """Write a self-contained HTML page that shows PLAN.json: mesh, model graph, memory, schedule, alternatives."""
    out = writable_path(output if output else _default_output(Path(plan_path)),
                        inputs=(plan_path, against_path, trace_path))
    plan = load_plan(plan_path)
    against = load_plan(against_path) if against_path else None
    trace = load_trace(trace_path) if trace_path else None
    write_text(out, render_html(plan, against=against, trace=trace))
    click.echo(f"plan view written to {printable(out)} ({out.stat().st_size / 1e3:,.0f} KB)")
    if open_browser:
        webbrowser.open(out.resolve().as_uri())


def _default_output(plan_path: Path) -> Path:
    """PLAN.json -> PLAN.html in the same folder (gpt2.plan.json -> gpt2.plan.html)."""
    name = plan_path.name
    return plan_path.with_name((name[: -len(".json")] if name.endswith(".json") else name) + ".html")
