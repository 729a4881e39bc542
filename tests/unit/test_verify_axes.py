"""`partita verify` knows every axis (issue 41): a hand edit of a plan that `partita compile` could
not have written is refused, whichever axis it touches, with one message naming the field.

The plans are the golden set's (tests/data/golden/), read back with their format fields; each edit
is checked against the unedited plan passing, so the check can fail both ways.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from partita.core.errors import PartitaError
from partita.core.plans.plan import SCHEMA_VERSION, Plan
from partita.core.plans.verify import plan_problems, verified_plan
from tests.golden import FOLDER, MODELS

Q_PROJ = "model.model.layers.0.self_attn.q_proj.weight"
EMBEDDING = "model.model.embed_tokens.weight"
EXPERT = "model.model.layers.0.mlp.experts.gate_up_proj"


def golden(name: str) -> dict[str, Any]:
    """A golden plan as the plan file `partita compile` wrote (its format fields back, unsealed)."""
    data = json.loads((FOLDER / f"{name}.json").read_text())
    data.pop("golden")
    data["version"] = SCHEMA_VERSION
    data["analysis_seconds"] = {}
    data["solver"]["seconds"] = 0.0
    return data


def param(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in data["params"] if p["name"] == name)


def edited(name: str, edit: Any) -> dict[str, Any]:
    """Golden plan ``name`` with ``edit(data)`` applied."""
    data = golden(name)
    edit(data)
    return data


def setter(*path: Any, value: Any) -> Any:
    def edit(data: dict[str, Any]) -> None:
        for k in path[:-1]:
            data = data[k]
        data[path[-1]] = value
    return edit


def refusal(data: dict[str, Any]) -> str | None:
    """Why loading refuses ``data`` (the schema, then ``plan_problems``), or None."""
    try:
        verified_plan(data, source="edited plan", sealed=False)
    except PartitaError as e:
        return e.message
    return None


def move_ep_layout(to: str) -> Any:
    def edit(data: dict[str, Any]) -> None:
        param(data, to)["layout"]["ep"] = param(data, EXPERT)["layout"]["ep"]
    return edit


# The four edits issue 41 found verify passing: (golden plan, edit, the field the message names)
UNCAUGHT = {
    "sequence parallel at tp=1": ("gpt-tiny-local2", setter("training", "sequence_parallel", value=True),
                                  "training.sequence_parallel = true with mesh.tp = 1"),
    "ep on a dense model": ("gpt-tiny-local2", setter("mesh", "ep", value=2),
                            "mesh.ep = 2: the model has no mixture-of-experts layer"),
    "expert layout on q_proj": ("mixtral-ep2", move_ep_layout(Q_PROJ),
                                f"parameter {Q_PROJ}: ep layout shard(0), but it is no expert weight"),
    "expert layout on the embedding": ("mixtral-ep2", move_ep_layout(EMBEDDING),
                                       f"parameter {EMBEDDING}: ep layout shard(0), but it is no expert weight"),
    "selective recompute without attention": ("mlp-local2", setter("stages", 0, "recompute", value="selective"),
                                              "stages[0].recompute = 'selective': the model has no attention "
                                              "core"),
}


@pytest.mark.parametrize("name", list(UNCAUGHT))
def test_partita_verify_refuses_the_edit_and_passes_the_plan(cli, tmp_path, name):
    plan, edit, expected = UNCAUGHT[name]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(golden(plan)))
    code, out, err = cli("verify", path)
    assert code == 0 and "every check passed" in out, err
    path.write_text(json.dumps(edited(plan, edit)))
    code, out, err = cli("verify", path)
    assert code != 0 and "Traceback" not in err
    assert expected in " ".join(err.split()), err


@pytest.mark.parametrize("name", list(UNCAUGHT))
def test_plan_problems_names_the_edit_once(name):
    plan, edit, expected = UNCAUGHT[name]
    problems = plan_problems(Plan.from_dict(edited(plan, edit)))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_plans_attention_cores_are_the_graphs():
    """verify finds a plan's attention cores from its node decisions by the rule the planner applies to
    the graph (core/recompute.py): the same cores, matmul-softmax-matmul spans included, so a selective
    plan compile wrote is not refused for lacking them."""
    from examples.models import GPT, GPTConfig
    from partita.compiler.compile import compile_model
    from partita.core.model.capture import capture
    from partita.core.model.inputs import parse_input_spec
    from partita.core.model.losses import resolve_loss
    from partita.core.options import Options
    from partita.core.recompute import attention_cores, decided_cores

    def model() -> GPT:
        return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, flash=False))

    plan = compile_model(model, Options(inputs=["idx=int64[4,32]"], cluster="local", devices=1,
                                        recompute="selective"), name="gpt-eager").plan
    assert [s.recompute for s in plan.stages] == ["selective"] and plan_problems(plan) == []
    captured = capture(model(), [parse_input_spec(s) for s in plan.model.inputs], loss=resolve_loss(None),
                       targets=parse_input_spec(plan.model.targets))
    graph = attention_cores(captured.graph_module.graph.nodes, {d.name: d.layer for d in plan.nodes if d.layer},
                            {*captured.param_nodes, *captured.buffer_nodes})
    assert len(set(graph.values())) == 2 and len(graph) > 2  # one core per layer, each a span of nodes
    assert decided_cores(plan.nodes, {"idx", "targets"}) == graph
    assert decided_cores(plan.nodes, set()) == {}  # no model input: no scores matmul opens a core


# -- every axis: one edit compile could not have written, refused by loading --------------------

def _cp_on_sequence(cp: int, seq: int | None) -> Any:
    """mesh.cp = ``cp`` (each rank's micro-batch ``cp`` times the samples: the batch splits over dp / cp)
    on a plan whose inputs carry a sequence of ``seq`` tokens (None: as planned)."""
    def edit(data: dict[str, Any]) -> None:
        data["mesh"]["cp"] = cp
        data["training"]["micro_batch_size"] *= cp
        if seq is not None:
            data["model"]["inputs"] = [s.replace(",64]", f",{seq}]") for s in data["model"]["inputs"]]
    return edit


def _first_linear(data: dict[str, Any]) -> dict[str, Any]:
    return next(n for n in data["nodes"] if n["op"] == "aten.linear.default")


AXES = {
    "context: cp on a model without attention": ("cnn-local2", _cp_on_sequence(2, None),
                                                 "mesh.cp = 2: the model has no attention core"),
    "context: cp that does not split the sequence": ("gpt-tiny-local2", _cp_on_sequence(2, 66),
                                                     "mesh.cp = 2 does not split the sequence of 66 tokens"),
    "context: cp beside ep": ("mixtral-ep2", _cp_on_sequence(2, None), "mesh.cp = 2 with mesh.ep = 2"),
    "context: cp_attention unknown": ("gpt-tiny-local2", setter("training", "cp_attention", value="star"),
                                      "training/cp_attention"),
    "data: dp does not give the batch": ("gpt-tiny-local2", setter("mesh", "dp", value=3),
                                         "does not equal global_batch"),
    "sequence parallel": ("gpt-tiny-local2", setter("training", "sequence_parallel", value=True),
                          "training.sequence_parallel"),
    "experts: ep degree": ("gpt-tiny-local2", setter("mesh", "ep", value=2), "mesh.ep = 2"),
    "experts: ep layout": ("mixtral-ep2", move_ep_layout(Q_PROJ), "ep layout"),
    "experts: ep beside offload": ("mixtral-ep2", setter("training", "offload", value="optimizer"),
                                   "mesh.ep = 2 with training.offload"),
    "experts: a load on a dense model": ("gpt-tiny-local2", setter("training", "expert_load", value=1.5),
                                         "training.expert_load = 1.5: the model has no mixture-of-experts layer"),
    "experts: a load above ep": ("mixtral-ep2", setter("training", "expert_load", value=3.0),
                                 "training.expert_load = 3.0 with mesh.ep = 2: the slowest rank"),
    "experts: a load below 1": ("mixtral-ep2", setter("training", "expert_load", value=0.5), "training/expert_load"),
    "recompute: selective": ("mlp-local2", setter("stages", 0, "recompute", value="selective"),
                             "stages[0].recompute"),
    "recompute: full": ("mlp-local2", setter("stages", 0, "recompute", value="full"), "stages[0].recompute"),
    "recompute: unknown mode": ("gpt-tiny-local2", setter("stages", 0, "recompute", value="half"),
                                "stages/0/recompute"),
    "offload": ("gpt-tiny-local2", setter("training", "offload", value="disk"), "training/offload"),
    "offload in inference": ("gpt-4l-inference", setter("training", "offload", value="optimizer"),
                             "training.offload = 'optimizer' with training.inference = true"),
    "ZeRO stage": ("gpt-tiny-local2", setter("training", "zero_stage", value=7), "training/zero_stage"),
    "ZeRO at dp=1": ("mlp-local2", setter("training", "zero_stage", value=1),
                     "training.zero_stage = 1 with mesh.dp = 1"),
    "pipeline schedule": ("gpt-tiny-pp2", setter("training", "schedule", value="zigzag"), "training/schedule"),
    "pipeline schedule at pp=1": ("gpt-tiny-local2", setter("training", "schedule", value="1f1b"),
                                  "training.schedule = '1f1b' schedules pipeline stages, but mesh.pp = 1"),
    "pipeline chunks": ("gpt-tiny-pp2", setter("training", "chunks", value=3), "one chunk per rank, not 3"),
    "tp: a node's placement at tp=1": ("gpt-tiny-local2", lambda d: _first_linear(d).update(out=["shard(1)"]),
                                       "placement shard(1) with tp=1"),
    "tp: a parameter's layout at tp=1": ("gpt-tiny-local2",
                                         lambda d: d["params"][0]["layout"].update(tp="shard(0)"),
                                         "tp layout shard(0) with tp=1"),
    "tp: a layout that does not divide": ("gpt-tiny-tp2", lambda d: d["params"][0]["layout"].update(tp="shard(5)"),
                                          "does not divide its shape over tp=2"),
}


# each edit's axis in the registry (core/axes)
REGISTERED = {"context": "context parallelism", "data": "data parallelism", "sequence parallel": "sequence parallelism",
              "experts": "expert parallelism",
              "recompute": "recomputation", "offload": "offload", "ZeRO": "ZeRO", "pipeline": "pipeline parallelism",
              "tp": "tensor parallelism"}


def test_every_axis_has_an_edit_and_each_is_refused():
    from partita.core.axes import AXES as REGISTRY

    edited_axes = {REGISTERED[next(k for k in REGISTERED if a.startswith(k))] for a in AXES}
    missing = {axis.name for axis in REGISTRY} - edited_axes
    assert not missing, f"axes in core/axes with no hand edit here: {missing}"
    passed = [plan for plan, _, _ in AXES.values() if refusal(golden(plan)) is not None]
    assert not passed, f"unedited plans refused: {passed}"
    wrong = {}
    for axis, (plan, edit, expected) in AXES.items():
        why = refusal(edited(plan, edit))
        if why is None or expected not in why:
            wrong[axis] = why
    assert not wrong, wrong


# -- against the model: which parameters are experts is the graph's to say ------------------------

@pytest.fixture(scope="module")
def mixtral_plan():
    """The golden case mixtral-ep2 planned by this torch (the kept file's node names are its torch's)."""
    from tests.golden import CASES, plan_of

    return plan_of(next(c for c in CASES if c.id == "mixtral-ep2"))


def fresh(data: dict[str, Any], edit: Any = None) -> dict[str, Any]:
    import copy

    data = copy.deepcopy(data)
    if edit is not None:
        edit(data)
    return data


@pytest.fixture(scope="module")
def mixtral_captured(mixtral_plan):
    """The golden set's tiny Mixtral captured as a rank of mixtral-ep2 captures it (at the micro-batch)."""
    import torch

    from partita.core.model.capture import capture
    from partita.core.model.inputs import InputSpec, parse_input_spec
    from partita.core.model.losses import resolve_loss

    data = mixtral_plan

    def micro(text: str) -> InputSpec:
        spec = parse_input_spec(text)
        return InputSpec(spec.name, spec.dtype, (data["training"]["micro_batch_size"], *spec.shape[1:]))

    torch.manual_seed(0)
    return capture(MODELS["mixtral"][0](), [micro(s) for s in data["model"]["inputs"]], loss=resolve_loss(None),
                   targets=micro(data["model"]["targets"]))


def test_the_run_checks_each_ep_layout_against_the_graphs_experts(mixtral_plan, mixtral_captured):
    """A rank checks every ep layout against core/experts.py's expert weights on the graph: an expert
    weight left replicated at ep=2 (which verify, knowing modules only, cannot tell) is refused there,
    as is an ep layout on q_proj; the unedited plan holds."""
    from partita.core.plans.verify import check_layouts

    check_layouts(verified_plan(fresh(mixtral_plan), sealed=False), mixtral_captured)

    def unsplit(data: dict[str, Any]) -> None:
        del param(data, EXPERT)["layout"]["ep"]

    plan = verified_plan(fresh(mixtral_plan, unsplit), sealed=False)  # passes without the model
    with pytest.raises(PartitaError, match=f"parameter {EXPERT}: ep layout replicate at mesh.ep = 2, but it is an "
                                           "expert weight"):
        check_layouts(plan, mixtral_captured)
    plan = Plan.from_dict(fresh(mixtral_plan, move_ep_layout(Q_PROJ)))
    with pytest.raises(PartitaError, match=f"parameter {Q_PROJ}: ep layout shard\\(0\\), but this model does not "
                                           "stack it over experts"):
        check_layouts(plan, mixtral_captured)


# -- the registry's cards: what the report and the viewer say of each axis ------------------------

@pytest.mark.parametrize("name, on", [
    ("gpt-tiny-local", {"data parallelism"}),
    ("gpt-4l-interleaved", {"data parallelism", "pipeline parallelism"}),
    ("hf-llama-1b-h100-pp4-sp", {"tensor parallelism", "pipeline parallelism", "sequence parallelism"}),
    ("mixtral-ep2", {"data parallelism", "expert parallelism"}),
    ("gpt-tiny-offload", {"data parallelism", "offload"}),
    ("gpt-tiny-zero3", {"data parallelism", "ZeRO"}),
    ("gpt-4l-selective", {"data parallelism", "recomputation"}),
])
def test_each_axis_says_what_the_plan_decided(name, on):
    """Every registered axis is in the summary, in the registry's order; those the plan uses say how
    (with its degree), the rest are off; `partita show`'s axes table lists the same."""
    from rich.console import Console

    from partita.compiler.report import axes_table
    from partita.core.axes import AXES, axis_summary

    plan = Plan.from_dict(golden(name))
    summary = axis_summary(plan)
    assert [a for a, _ in summary] == [a.name for a in AXES]
    assert {a for a, decided in summary if decided} == on
    said = dict(summary)
    if "pipeline parallelism" in on:
        assert said["pipeline parallelism"].startswith(f"pp = {plan.mesh.pp}: {plan.training.schedule}")
    if "expert parallelism" in on:
        assert said["expert parallelism"].startswith(f"ep = {plan.mesh.ep}")
    console = Console(width=200, record=True)
    console.print(axes_table(plan))
    text = console.export_text()
    import re

    off = [line for line in text.splitlines() if re.search(r"\soff\s*\W?\s*$", line)]
    assert all(a.name in text for a in AXES) and len(off) == len(AXES) - len(on), text
