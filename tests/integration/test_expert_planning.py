"""Expert parallelism, planned: what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_expert_planning.py has the one-process checks."""

from __future__ import annotations

from partita.compiler.report import expert_layout, plan_report
from partita.compiler.view import page_data, render_html
from tests.unit.test_expert_planning import EXPERTS, LAYERS, ep2  # noqa: F401 (fixtures)


def test_report_and_view_show_the_expert_groups(ep2, open_page):
    lay = expert_layout(ep2)
    assert lay["groups"] == [[0, 1], [2, 3]]
    assert [(x["module"], x["experts"], x["per_rank"]) for x in lay["layers"]] == [
        (f"model.layers.{i}.mlp.experts", EXPERTS, EXPERTS // 2) for i in range(LAYERS)]
    held = {r["rank"]: (r["experts"]["model.layers.1.mlp.experts"], r["edp"]) for r in lay["ranks"]}
    assert held == {0: ([0, 1], [0, 2]), 1: ([2, 3], [1, 3]), 2: ([0, 1], [0, 2]), 3: ([2, 3], [1, 3])}
    assert page_data(ep2)["experts"] == lay

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan_report(ep2))
    text = console.export_text()
    assert "dp=4 x tp=1 x pp=1 (ep=2)" in text and "expert parallelism (ep=2)" in text
    assert "experts 2-3 of every MoE layer" in text and "0: ranks 0, 1" in text

    page = open_page(render_html(ep2))
    assert page.text_content('[data-field="mesh"]').startswith("dp=4 x tp=1 x pp=1 (ep=2)")
    rows = page.eval_on_selector_all("table.experts tbody tr",
                                     "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert rows == [["0: ranks 0, 1", "0", "experts 0-1 of every MoE layer", "0, 2"],
                    ["", "1", "experts 2-3 of every MoE layer", "1, 3"],
                    ["1: ranks 2, 3", "2", "experts 0-1 of every MoE layer", "0, 2"],
                    ["", "3", "experts 2-3 of every MoE layer", "1, 3"]]
    groups = page.eval_on_selector_all("g.device", "es => es.map(e => e.dataset.expertGroup)")
    assert groups == ["0", "0", "1", "1"]
