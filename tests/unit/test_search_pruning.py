"""The pruned joint search chooses what the exhaustive one chooses, and what it prunes could not win.

``plan_search(prune=False)`` cuts every (p, micro-batch) group; the default
prunes a group whose lower bound (passes/pipeline/stages.PipelineBound)
exceeds the best step found, or that no cuts fit even at 1/tp of every layer,
and cuts the rest under a cap on the slowest slot (``PipelineBound.slot_cap``).
Both must return the same plan to the last bit of its predicted step, and each
pruned group must be one the exhaustive search shows losing: every candidate it
cut there is no faster than the bound, or none fits. The space is also searched
with ZeRO 1-3 weighed inside pipelines and ZeRO-3 with tp > 1 (the wider
``zero_stages`` the runtime is growing into), where it is largest.
"""

from __future__ import annotations

import functools
import math

import pytest

from examples.models import GPT, GPTConfig
from partita.core.cluster import PRESETS
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.passes.cost_model import ZERO_STAGES
from partita.passes.pipeline import stages as pipeline_parallel
from partita.passes.pipeline.costs import node_costs
from partita.passes.pipeline.stages import choose_pipeline
from partita.passes.profile import profile_model
from partita.passes.search import plan_search
from partita.passes.tp import mesh as tensor_parallel
from partita.passes.tp.layout_costs import tp_node_costs


@functools.cache
def _gpt(layers: int, width: int, heads: int, seq: int = 1024):
    cfg = GPTConfig(vocab_size=50304, block_size=seq, n_layer=layers, n_head=heads, n_embd=width)
    captured = capture(lambda: GPT(cfg), [parse_input_spec(f"idx=int64[1,{seq}]")], loss=default_loss)
    return profile_model(captured), [math.prod(shape) for shape, _ in captured.params.values()]


def _every_zero_stage(pinned: int | None, dp: int, inference: bool, *, tp: int = 1, pp: int = 1) -> tuple[int, ...]:
    """ZeRO 0-3 at every (tp, pp): the widest space the search may be asked to cover."""
    if pinned is not None:
        return (pinned,)
    return (0,) if dp <= 1 or inference else ZERO_STAGES


CASES = {  # name: (model, cluster, global batch)
    # 40B in 12 wide layers over 10 GbE: pp = 1 does not fit, pipelines at every tp
    "40b-10gbe": ((12, 16384, 128, 2048), PRESETS["ethernet-10g"].with_nodes(4), 64),
    # 7.3B on two DGX nodes: pipelines compete with ZeRO at pp = 1
    "7b-2-nodes": ((16, 6144, 48, 1024), PRESETS["dgx-a100"].with_nodes(2), 32),
}


def _request(batch: int) -> TrainingRequest:
    return TrainingRequest(global_batch=batch, precision="bf16-mixed")


def _same_plan(a, b) -> None:
    assert (a.mesh, a.zero_stage, a.micro_batch_size, a.grad_accum_steps, a.schedule) == \
        (b.mesh, b.zero_stage, b.micro_batch_size, b.grad_accum_steps, b.schedule)
    assert a.step_s == pytest.approx(b.step_s, rel=1e-9)
    assert dict(a.node_stage) == dict(b.node_stage)
    assert dict(a.choice) == dict(b.choice)


@pytest.mark.parametrize("wide_zero", [False, True], ids=["runtime-zero", "zero-everywhere"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pruned_search_chooses_the_exhaustive_plan(name, wide_zero, monkeypatch):
    if wide_zero:
        monkeypatch.setattr(pipeline_parallel, "zero_stages", _every_zero_stage)
        monkeypatch.setattr(tensor_parallel, "zero_stages", _every_zero_stage)
    dims, cluster, batch = CASES[name]
    prof, numels = _gpt(*dims)
    exhaustive = plan_search(prof, numels, cluster, _request(batch), prune=False)
    pruned = plan_search(prof, numels, cluster, _request(batch))
    _same_plan(pruned, exhaustive)
    assert pruned.pruned > 0 and pruned.candidates < exhaustive.candidates
    assert exhaustive.pruned == 0
    # what was not cut is still in the plan's why, with the bound it lost by
    not_cut = [a for a in pruned.alternatives if a.reason.startswith(("not solved", "does not fit: no cuts"))]
    assert not_cut and all(not a.fits and not a.chosen for a in not_cut)
    for a in not_cut:
        if a.reason.startswith("not solved:"):
            bound, best = (float(x.split(" s")[0]) for x in a.reason.split("lower bound ")[1].split(" > best "))
            assert bound > best >= pruned.step_s * (1 - 1e-3)
        elif a.reason.startswith("not solved to the end"):  # cut under a cap on the slot, by a (schedule, ZeRO)
            assert float(a.reason.split("above the best ")[1].split(" s")[0]) >= pruned.step_s * (1 - 1e-3)


@pytest.mark.parametrize("tp", [1, 4])
def test_every_pruned_group_loses_in_the_exhaustive_search(tp, monkeypatch):
    """The bound is sound: the exhaustive search's candidates in a pruned group are no faster than
    its bound, and a group pruned for memory has no candidate that fits."""
    monkeypatch.setattr(pipeline_parallel, "zero_stages", _every_zero_stage)
    dims, cluster, batch = CASES["40b-10gbe"]
    prof, _ = _gpt(*dims)
    request = _request(batch)
    costs = functools.lru_cache(maxsize=None)(lambda mb: tp_node_costs(prof, cluster, request, mb, tp))
    floor = (lambda mb: node_costs(prof, cluster, request, mb, tp=tp)) if tp > 1 else costs
    kw = dict(devices_per_stage=tp, costs=costs)
    full = choose_pipeline(prof, cluster, request, Pins(tp=tp), **kw)
    # a bound a little above the best forces pruning against an outside plan as plan_search does
    quick = choose_pipeline(prof, cluster, request, Pins(tp=tp), floor_costs=floor, prune=True,
                            bound=full.best.step_s * 1.5, **kw)
    assert quick.best.key == full.best.key and quick.best.step_s == full.best.step_s
    assert quick.pruned and quick.solves < full.solves
    by_group: dict[tuple[int, int, int], list] = {}
    for c in full.candidates:
        by_group.setdefault((c.pp, c.dp, c.micro_batch_size), []).append(c)
    for x in quick.pruned:
        group = by_group.get((x.pp, x.dp, x.micro_batch_size), [])
        if x.memory:
            assert not any(c.fits for c in group if x.schedule in ("", c.schedule)), x.reason
        elif not x.schedule:  # the group's lower bound
            assert all(c.step_s >= x.lower_bound_s for c in group), x.reason
            assert x.lower_bound_s > full.best.step_s
        else:  # one (schedule, ZeRO stage) of the group, cut under a cap from the best found by then
            same = [c for c in group if c.schedule == x.schedule and c.zero_stage == x.zero_stage]
            assert all(c.step_s >= x.lower_bound_s * (1 - 1e-9) for c in same), x.reason
            assert x.lower_bound_s >= full.best.step_s


def test_the_bound_holds_where_the_optimizer_runs_on_the_host():
    """With offload pinned, a stage's optimizer step is the host's, which can be faster than the
    device's pass: the bound takes the lesser (``PipelineBound.host``). Before, its device term put
    the bound of the best group above that group's own step, so the group pruned itself once the
    probe had found it, and a slower plan was chosen."""
    from examples.models import gpt_tiny
    from partita.core.cluster import load_cluster

    captured = capture(gpt_tiny, [parse_input_spec("idx=int64[8,16]")], loss=default_loss)
    prof = profile_model(captured)
    numels = [math.prod(shape) for shape, _ in captured.params.values()]
    request = TrainingRequest(global_batch=8, precision="bf16-mixed", optimizer="sgd-momentum")
    pins = Pins(dp=2, zero_stage=2, offload="optimizer", world_size=2)
    cluster = load_cluster("local", devices=2)
    _same_plan(plan_search(prof, numels, cluster, request, pins),
               plan_search(prof, numels, cluster, request, pins, prune=False))
