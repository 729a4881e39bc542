"""A mutation matrix over a real plan: every field class of the tp=2 GPT plan is edited (and the
plan re-sealed, as `partita verify` would), and each edit must be refused, or be a field that
does not change the run (proven by an identical run), or a decision a user may change (which the
run then follows).

Refused means one of: loading refuses it (``load_plan``: schema, the decisions' rules, the
mesh against the cluster), or the check against the model does (the graph's fingerprint and
every strategy, placement and collective re-derived on the captured graph: what each rank runs
before its first step). A new field class of the plan lands in none of the lists and fails here
until someone says which it is.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest

from partita.core.errors import PartitaError
from partita.core.plans.plan import SEAL, seal_digest

# Read by nothing that runs: predictions, explanations, the solver's report, timings, summaries
# the viewer shows. test_harmless_edits_train_identically runs a plan with all of them edited.
HARMLESS = {
    "model.name", "model.num_params", "model.param_bytes", "model.capture_method", "model.num_nodes",
    "model.repeated_layers[]", "model.loss",
    "cluster.name", "cluster.device_name", "cluster.memory_bytes", "cluster.flops.fp32", "cluster.flops.bf16",
    "cluster.efficiency", "cluster.hbm_bandwidth", "cluster.intra_node_bandwidth", "cluster.inter_node_bandwidth",
    "cluster.intra_node_latency", "cluster.inter_node_latency", "cluster.nvlink", "cluster.memory_reserve",
    "cluster.step_overhead_s", "cluster.roofline", "cluster.source", "cluster.nodes", "cluster.gpus_per_node",
    "cluster.attention_efficiency", "cluster.memory_efficiency", "cluster.kernel_s", "cluster.launch_s",
    "cluster.alloc_granularity", "cluster.fragmentation", "cluster.sources.all", "cluster.host_bandwidth",
    "cluster.host_memory_bandwidth",
    "training.grad_bucket_bytes",  # how gradients are grouped for the all-reduce, not what is summed
    "nodes[].module", "nodes[].layer", "nodes[].flops_fwd", "nodes[].compute_s", "nodes[].ins[].bytes",
    "nodes[].op",  # the graph's own op is run; the plan's is its label (the fingerprint covers the graph)
    "params[].name", "params[].shape[]", "params[].dtype", "params[].layout.dp",
    "collectives[].kind", "collectives[].bytes", "collectives[].count", "collectives[].purpose",
    "collectives[].seconds",
    "stages[].nodes", "stages[].first_node", "stages[].last_node", "stages[].params", "stages[].predicted_time_s",
    "stages[].memory_bytes", "stages[].forward_s", "stages[].backward_s", "stages[].modules[]",
    "stages[].send_bytes",
    "stages[].recompute",  # recomputation reruns the same forward: the same numbers
    "training.sequence_parallel",  # the layouts are the nodes'; a regathered linear input computes the same
}
HARMLESS |= {f"predicted.{k}" for k in (
    "step_time_s", "compute_s", "comm_s.tp_forward", "comm_s.tp_backward", "comm_s.tp_internal", "optimizer_s",
    "memory.params", "memory.grads", "memory.optimizer", "memory.activations", "memory.capacity", "samples_per_s",
    "memory.transient", "memory.collectives", "memory.step", "memory.allocator", "memory.autocast",
    "memory.backward_grads", "memory.host", "sources.compute", "sources.communication", "sources.optimizer",
    "sources.memory",
    "tokens_per_s", "model_tflops_per_device", "mfu")}
HARMLESS |= {f"solver.{k}" for k in ("method", "status", "objective", "seconds", "candidates", "gap", "notes[]")}
HARMLESS |= {f"alternatives[].{k}" for k in ("mesh.dp", "mesh.tp", "mesh.pp", "micro_batch_size",
                                             "grad_accum_steps", "zero_stage", "step_time_s", "memory_bytes",
                                             "fits", "chosen", "reason")}
HARMLESS |= {f"analysis_seconds.{k}" for k in ("capture", "analysis", "batch_shapes", "solve", "layout")}

# Decisions a user may edit by hand and re-verify: the run does what the edited plan says.
DECISIONS = {"training.max_grad_norm"}


def field_classes(data: Any) -> dict[str, list[tuple[list, Any]]]:
    """Leaf paths of the plan's JSON grouped by class (list indices as ``[]``): class -> [(path, value)]."""
    out: dict[str, list[tuple[list, Any]]] = collections.OrderedDict()

    def walk(v: Any, path: list, cls: str) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, path + [k], f"{cls}.{k}" if cls else k)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, path + [i], cls + "[]")
        elif cls != SEAL:
            out.setdefault(cls, []).append((path, v))

    walk(data, [], "")
    return out


def _other(v: Any, values: list) -> Any:
    """Another value of the same type: another value the class takes elsewhere in the plan when it
    has one (a strategy another node uses), else a nearby one."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.5 + 0.25
    if isinstance(v, str):
        alternatives = sorted({o for o in values if isinstance(o, str) and o != v})
        return alternatives[0] if alternatives else v + "x"
    return 1  # None: a value where the plan has none


def mutations(good: dict) -> dict[str, dict]:
    """One edited, re-sealed plan per field class; the edit hits an occurrence whose value is not
    the class's most common one where there is such (a sharded strategy, not the 94th replicate)."""
    out = {}
    for cls, occurrences in field_classes(good).items():
        values = [v for _, v in occurrences]
        common = collections.Counter(map(repr, values)).most_common(1)[0][0]
        path, v = next(((p, x) for p, x in occurrences if repr(x) != common), occurrences[0])
        data = json.loads(json.dumps(good))
        target = data
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = _other(v, values)
        data[SEAL] = seal_digest(data)
        out[cls] = data
    return out


@pytest.fixture(scope="module")
def good(tp2_plan_path) -> dict:
    return json.loads(tp2_plan_path.read_text())


@pytest.fixture(scope="module")
def captured(good):
    """The example GPT captured as every rank captures it for this plan (its inputs and loss)."""
    import torch

    from examples.models import gpt_tiny
    from partita.core.model.capture import capture
    from partita.core.model.inputs import parse_input_spec
    from partita.core.model.losses import resolve_loss

    torch.manual_seed(0)
    return capture(gpt_tiny(), [parse_input_spec(s) for s in good["model"]["inputs"]], loss=resolve_loss(None),
                   targets=parse_input_spec(good["model"]["targets"]))


def refused(data: dict, captured) -> str | None:
    """Why the plan is refused (at load, or against the model as a rank checks it), or None."""
    from partita.core.model.graph import graph_fingerprint, to_networkx
    from partita.core.plans.verify import check_layouts, verified_plan
    from partita.runtime.compose import refuse_unsupported

    try:
        plan = verified_plan(data, source="edited plan")
        refuse_unsupported(plan)
        plan.check_matches(fingerprint=graph_fingerprint(to_networkx(captured)), world_size=2)
        check_layouts(plan, captured)
    except PartitaError as e:
        assert "\n" not in e.message and e.hint, e
        return e.message
    return None


def test_every_field_class_is_refused_harmless_or_a_decision(good, captured):
    classes = field_classes(good)
    assert len(classes) > 100  # the matrix sees the whole plan
    accepted, kinds = [], collections.Counter()
    for cls, data in mutations(good).items():
        why = refused(data, captured)
        if why is None:
            accepted.append(cls)
            kinds["harmless" if cls in HARMLESS else "decision" if cls in DECISIONS else "unexplained"] += 1
        else:
            kinds["refused"] += 1
    unexplained = [c for c in accepted if c not in HARMLESS | DECISIONS]
    assert not unexplained, f"edits loaded that are neither harmless nor a decision: {unexplained}"
    assert kinds["refused"] >= 30, kinds


