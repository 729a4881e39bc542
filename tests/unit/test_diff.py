"""`partita diff`: what changed between two plans, on the terminal and as data for the view."""

import dataclasses

import pytest
from click.testing import CliRunner
from rich.console import Console

from partita.compiler.diff import diff_command, diff_plans, diff_table
from partita.core.errors import PlanError
from partita.core.mesh import Mesh
from tests.synthetic_plans import small_plan


def text_of(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


@pytest.fixture(scope="module")
def a():
    return small_plan()


def changed(a, *, q_proj_layout=None, drop_reshard=True, step_factor=0.8, move_stage=True):
    """``a`` with o_proj of layer 0 replicated, one forward all-reduce gone, a moved stage boundary, a faster step."""
    params = tuple(dataclasses.replace(p, layout={**p.layout, "tp": "replicate"})
                   if p.name == "model.layers.0.self_attn.o_proj.weight" else p for p in a.params)
    nodes = list(a.nodes)
    for i, n in enumerate(nodes):
        if n.module == "model.layers.0.self_attn.o_proj":
            nodes[i] = dataclasses.replace(n, strategy="replicate")
        if drop_reshard and n.layer == "model.layers.0" and any(e.fwd == "all_reduce" for e in n.ins):
            nodes[i] = dataclasses.replace(n, ins=tuple(dataclasses.replace(e, fwd="none", have="replicate")
                                                        for e in n.ins))
            drop_reshard = False
    stages = list(a.stages)
    if move_stage:
        stages[1] = dataclasses.replace(stages[1], first_node="add_99", nodes=stages[1].nodes + 1)
    predicted = dataclasses.replace(a.predicted, step_time_s=a.predicted.step_time_s * step_factor,
                                    samples_per_s=a.predicted.samples_per_s / step_factor)
    return dataclasses.replace(a, params=params, nodes=tuple(nodes), stages=tuple(stages), predicted=predicted)


def test_a_plan_against_itself_is_identical(a):
    d = diff_plans(a, a)
    assert d.identical and d.same_model
    assert not (d.layouts or d.stages or d.collectives_added or d.collectives_removed or d.mesh)
    assert "same decisions and predictions" in text_of(diff_table(d))


def test_layout_stage_collective_and_metric_changes_are_found(a):
    b = changed(a)
    d = diff_plans(a, b)
    assert not d.identical
    mods = {lc.module: lc for lc in d.layouts}
    assert set(mods) == {"model.layers.0.self_attn.o_proj"}
    lc = mods["model.layers.0.self_attn.o_proj"]
    assert [(c.field, c.a, c.b) for c in lc.params] == [
        ("model.layers.0.self_attn.o_proj.weight", "tp=shard(1), dp=replicate", "tp=replicate, dp=replicate")]
    assert [(c.a, c.b) for c in lc.nodes] == [("row", "replicate")]
    assert [s.index for s in d.stages] == [1] and "add_99" in d.stages[0].b
    assert d.collectives_added == ()
    assert len(d.collectives_removed) == 1 and d.collectives_removed[0].startswith("forward all_reduce on ")
    step = next(m for m in d.metrics if m.name == "step time")
    assert step.ratio == pytest.approx(0.8) and step.better is True
    samples = next(m for m in d.metrics if m.name == "samples/s")
    assert samples.ratio == pytest.approx(1.25) and samples.better is True
    memory = next(m for m in d.metrics if m.name == "memory/device")
    assert memory.ratio == 1.0 and not memory.changed

    out = text_of(diff_table(d))
    for text in ("layout changes by module", "model.layers.0.self_attn.o_proj", "shard(1)", "stage boundaries",
                 "add_99", "collectives removed (1)", "0.8x", "1.25x"):
        assert text in out, text


def test_mesh_training_and_model_changes(a):
    b = small_plan(dp=4, micro_batches=8, zero=2, fingerprint="ffffffffffff0002")
    d = diff_plans(a, b)
    assert d.mesh.a == str(a.mesh) and d.mesh.b == str(Mesh(dp=4, tp=2, pp=2))
    assert {c.field: (c.a, c.b) for c in d.training}["zero_stage"] == (1, 2)
    assert {c.field: (c.a, c.b) for c in d.training}["grad_accum_steps"] == (4, 8)
    assert not d.same_model
    assert "fingerprints differ" in text_of(diff_table(d))
    assert d.to_dict()["mesh"] == {"field": "mesh", "a": str(a.mesh), "b": "dp=4 x tp=2 x pp=2"}


def test_diff_command_prints_the_changes_and_refuses_a_bad_file(a, tmp_path):
    # (a plan that drops a needed all-reduce is refused on load: only the consistent changes)
    pa, pb = a.save(tmp_path / "a.plan.json"), changed(a, drop_reshard=False).save(tmp_path / "b.plan.json")
    r = CliRunner().invoke(diff_command, [str(pa), str(pb)])
    assert r.exit_code == 0, r.output
    assert "plan diff" in r.output and "model.layers.0.self_attn.o_proj" in r.output

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = CliRunner().invoke(diff_command, [str(pa), str(bad)])
    assert isinstance(r.exception, PlanError) and "bad.json is not a valid plan file" in r.exception.message
