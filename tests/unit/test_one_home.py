"""Each rule has one home, and every user of it agrees (issue 14).

Divergences this guards against, each seen in an earlier version:
- the plan's pipeline collectives priced on another link than the planner's
  stage links (the loss broadcast was always inter-node);
- the TP ILP and the pipeline search pricing an int64 tensor at 8 and 4 bytes;
- the schedule's order, its activations in flight and the viewer's timeline
  disagreeing; placements parsed by hand with different rules.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from partita.core.cluster import PRESETS
from partita.core.mesh import Mesh, axis_crosses_nodes, crosses_nodes
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.core.pins import TrainingRequest
from partita.core.placement import Placement, is_shard, shard_dim
from partita.core.precision import activation_scale, dtype_bytes
from partita.core.schedule import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    chunks_of,
    gradients_received,
    in_flight,
    rank_order,
    sends_held,
)
from partita.passes.cost_model import collective_time
from partita.passes.profile import profile_model

# -- the mesh's rank layout ------------------------------------------------------------


def test_stage_links_on_three_nodes_follow_every_rank_not_the_first():
    """3 dgx-a100 nodes, pp=8 dp=3 tp=1: stage s holds ranks 3s..3s+2, so the cuts after stages 1,
    2, 4 and 5 have a pair of peers on two nodes (5 -> 8, 6 -> 9, 13 -> 16, 15 -> 18)."""
    cluster = PRESETS["dgx-a100"].with_nodes(3)
    links = cluster.stage_links(Mesh(dp=3, tp=1, pp=8))
    assert [ln.name for ln in links] == ["NVLink", "inter-node", "inter-node", "NVLink", "inter-node",
                                         "inter-node", "NVLink"]


@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 8), (3, 8), (4, 4), (2, 6)])
def test_group_links_agree_with_the_mesh(nodes, per_node):
    """``link_for_group(size, stride)``, which the solvers price dp and tp groups by, names the
    link the mesh's real groups run on (core/mesh.py), for every mesh of the cluster."""
    cluster = PRESETS["dgx-a100"].with_nodes(nodes).with_devices(per_node)
    world = cluster.world_size
    for tp in (d for d in range(1, per_node + 1) if per_node % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            mesh = Mesh(dp=world // (tp * pp), tp=tp, pp=pp)
            for axis, size, stride in (("dp", mesh.dp, tp), ("tp", tp, 1)):
                want = cluster.inter_link if axis_crosses_nodes(mesh, axis, per_node) else cluster.intra_link
                assert cluster.link_for_group(size, stride=stride) == want, (mesh, axis)


class _Stack(nn.Module):
    def __init__(self, width: int = 64, layers: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _plan(cluster, pins, batch=24):
    from partita.compiler.compile import compile_model

    return compile_model(_Stack, Options(inputs=[parse_input_spec("x=float32[24,64]")], cluster=cluster, batch=batch,
                                         **pins, loss=_mse, targets=parse_input_spec("y=float32[24,64]"))).plan


@pytest.mark.parametrize("nodes,pp,dp", [(3, 8, 3), (1, 2, 4)])
def test_the_plans_pipeline_collectives_use_the_planners_links(nodes, pp, dp):
    """Every send and the loss broadcast of the plan are priced on the link its ranks span: the
    stage pair's (the links the cuts were chosen by), the pp groups' for the broadcast."""

    cluster = PRESETS["dgx-a100"].with_nodes(nodes)
    plan = _plan(cluster, dict(pp=pp, dp=dp, tp=1))
    mesh = plan.mesh
    assert (mesh.pp, mesh.dp, mesh.tp) == (pp, dp, 1)
    links = cluster.stage_links(mesh)
    sends = [c for c in plan.collectives if c.kind == "send_recv"]
    assert sends
    for c in sends:
        stage_link = links[c.stage if "next" in c.purpose else c.stage - 1]
        assert c.seconds == pytest.approx(c.count * collective_time("send_recv", c.bytes, 2, stage_link))
    (bcast,) = [c for c in plan.collectives if c.kind == "broadcast"]
    pp_groups = mesh.groups("pp")
    link = cluster.inter_link if any(crosses_nodes(g, cluster.gpus_per_node) for g in pp_groups) else cluster.intra_link
    assert bcast.seconds == pytest.approx(collective_time("broadcast", bcast.bytes, pp, link))


# -- the per-node TP cost ----------------------------------------------------------------


class _Lookup(nn.Module):
    """Token ids shifted (an int64 op a TP layout may shard by rows) feed an embedding: a layout
    that shards the shift and keeps the embedding whole all-gathers int64 ids."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx + 1)


def test_an_int64_tensor_is_priced_at_8_bytes_by_the_ilp_and_the_pipeline_search():
    from partita.core.tp.strategies import node_strategies
    from partita.passes.tp.layout_costs import tp_node_costs
    from partita.passes.tp.problem import TPSetting, build_problem

    cluster = PRESETS["dgx-a100"]
    prof = profile_model(capture(_Lookup, [parse_input_spec("idx=int64[8,16]")], name="lookup"))
    G, t = prof.graph, 2
    request = TrainingRequest(global_batch=8, precision="bf16-mixed", inference=True)
    (shift,) = [n for n, a in G.nodes(data=True) if a["op"].startswith("aten.add")]
    (emb,) = [n for n, a in G.nodes(data=True) if a["op"].startswith("aten.embedding")]
    assert G.nodes[shift]["dtypes"] == ["int64"]
    gather = collective_time("all_gather", 8 * 16 * 8, t, cluster.link_for_group(t))  # 128 indices, 8 bytes
    # a choice that all-gathers the ids: the shift sharded on its rows, the embedding whole
    choice = {n: node_strategies(G, n, t)[0] for n in G.nodes}
    choice[shift] = next(s for s in node_strategies(G, shift, t) if s.out == ("shard(0)",))
    costs = tp_node_costs(prof, cluster, request, 8, t, choice=choice)
    at = {n: i for i, n in enumerate(costs.order)}
    base = tp_node_costs(prof, cluster, request, 8, 1)
    assert costs.forward_s[at[emb]] - base.forward_s[at[emb]] == pytest.approx(gather)
    # the ILP prices the same edge the same way
    problem = build_problem(G, TPSetting(t, 8, prof.batch_size, "bf16-mixed", inference=True), cluster)
    (edge,) = [e for e in problem.edges if problem.class_of[shift] == e.src and problem.class_of[emb] == e.dst]
    own_src, own_dst = problem.strategies_of[shift], problem.strategies_of[emb]
    i = own_src.index(choice[shift])
    j = own_dst.index(choice[emb])
    assert edge.fwd_s[i][j] == pytest.approx(gather)


# -- dtype sizes, placements, schedules --------------------------------------------------


def test_one_table_of_element_sizes():
    assert [dtype_bytes(n) for n in ("int64", "torch.int64", "float32", "bfloat16", "fp16", "bf16", "bool")] == \
        [8, 8, 4, 2, 2, 2, 1]
    assert activation_scale("bf16-mixed", "float32") == 0.5
    assert activation_scale("fp32", "bfloat16") == 2.0


def test_one_parser_of_placements():
    assert Placement.parse("shard(3)") == Placement("shard", 3) and str(Placement.parse("shard(3)")) == "shard(3)"
    assert Placement.parse("partial").kind == "partial"
    assert shard_dim("shard(12)") == 12 and shard_dim("sharded") is None
    assert is_shard("shard(0)") and not is_shard("replicate") and not is_shard("shard(x)")
    with pytest.raises(ValueError, match="not a placement"):
        Placement.parse("shard(-1)")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_in_flight_is_what_the_order_holds(schedule):
    """The memory the cost model charges (micro-batches in flight) is the most forwards the order
    the runtime runs keeps ahead of their backwards, on every stage."""
    v = chunks_of(schedule)
    for p in (1, 2, 4) if v == 1 else (2, 3, 4):
        for m in (1, 2, 3, 8) if v == 1 else (p, 2 * p, 3 * p):
            for s in range(p):
                ahead = peak = 0
                order = rank_order(schedule, s, p, m, v)
                for kind, _, _ in order:
                    ahead += 1 if kind == FORWARD else -1
                    peak = max(peak, ahead)
                # summed over the rank's chunks (each its share of the rank's peak)
                assert peak == sum(in_flight(schedule, c, p * v, m, v) for c in range(s, p * v, p)), (schedule, p, m, s)
                assert sorted((k, c) for kind, k, c in order if kind == BACKWARD) == sorted(
                    (k, c) for k in range(m) for c in range(s, p * v, p))


def test_a_chunked_order_holds_the_same_past_its_steady_state():
    """What a chunked schedule holds is walked over at most ``steady`` micro-batches: the counts
    do not change past it (walked in full up to 40 p)."""
    from partita.core import schedule as sched

    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in (sched.steady(p, 10**14, v), 10 * p, 40 * p):
                for r in range(p):
                    assert sched._chunk_peaks(sched.INTERLEAVED, r, p, m, v) == sched._chunk_peaks(
                        sched.INTERLEAVED, r, p, 2 * p, v), (p, v, m, r)
                    assert sched._walk_sends(sched.INTERLEAVED, r, p, m, v) == sched._walk_sends(
                        sched.INTERLEAVED, r, p, 2 * p, v), (p, v, m, r)
    assert sched.in_flight(sched.INTERLEAVED, 0, 16, 8 * 10**13, 2) > 0  # no walk over 10^14 micro-batches


def test_the_runtime_and_the_viewer_run_the_core_order():
    from partita.compiler.timeline import rank_order as drawn
    from partita.runtime.pipeline.stage import schedule_order

    for schedule in SCHEDULES:
        v = chunks_of(schedule)
        for s in range(4):
            core = rank_order(schedule, s, 4, 8, v)
            assert [("F" if k == FORWARD else "B", i, c) for k, i, c in core] == schedule_order(schedule, 4, s, 8, v)
            assert drawn(schedule, s, 4, 8, v) == core


def test_bucket_rule_is_shared():
    from partita.core.buckets import DEFAULT_BUCKET_BYTES
    from partita.passes.dp.buckets import gradient_buckets
    from partita.runtime.dp.buckets import bucket_layout

    params = [nn.Parameter(torch.zeros(n)) for n in (3_000_000, 5_000_000, 1_000, 4_000_000, 2_000_000)]
    assert bucket_layout(params, DEFAULT_BUCKET_BYTES) == gradient_buckets([p.numel() for p in params], 4)
    assert math.isclose(DEFAULT_BUCKET_BYTES, 25 * 2**20)


# -- the search space and the gradient rule ----------------------------------------------


def test_a_bad_tp_pin_is_refused_the_same_way_with_a_pipeline_pinned():
    """The pins are checked once, before any solve: --tp 3 on 8-GPU nodes is refused for what it
    is whether or not --pp is pinned too (a pipeline search used to skip the tp and end with
    'no plan matches the pins')."""
    from partita.core.errors import PartitaError
    from partita.core.pins import Pins
    from partita.passes.search import plan_search

    prof = profile_model(capture(_Stack, [parse_input_spec("x=float32[8,64]")], loss=_mse,
                                 targets=parse_input_spec("y=float32[8,64]")))
    numels = [64 * 64 + 64] * 8
    for pins in (Pins(tp=3), Pins(tp=3, pp=2)):
        with pytest.raises(PartitaError, match="--tp 3 does not divide 8 GPUs per node"):
            plan_search(prof, numels, PRESETS["dgx-a100"], TrainingRequest(global_batch=8), pins)


class _Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).detach())


def test_one_rule_for_where_a_gradient_flows():
    """A detached tensor carries no gradient for the FLOP count (no backward FLOPs, no gradient
    sent back over a cut) exactly as for the TP layouts' gradient placements."""
    from partita.core.tp.strategies import grad_flows

    prof = profile_model(capture(_Detached, [parse_input_spec("x=float32[4,32]")], loss=_mse,
                                 targets=parse_input_spec("y=float32[4,32]")))
    G = prof.graph
    detached = [n for n, a in G.nodes(data=True) if a["op"].startswith("aten.detach")]
    assert detached
    flows = grad_flows(G)
    for n, a in G.nodes(data=True):
        assert a["requires_grad"] == flows[n], n
    assert not any(G.nodes[n]["requires_grad"] for n in detached)
    # ... and the pipeline runtime decides which gradients cross a cut by the same rule
    from partita.core.model.ops import gradient_nodes

    captured = capture(_Detached, [parse_input_spec("x=float32[4,32]")], loss=_mse,
                       targets=parse_input_spec("y=float32[4,32]"))
    assert gradient_nodes(captured.graph_module.graph, captured.param_nodes) == {n for n, f in flows.items() if f}


def test_the_runtime_and_the_planner_agree_where_gradients_flow_in_a_real_model():
    from examples.models import gpt_tiny
    from partita.core.model.losses import default_loss
    from partita.core.model.ops import gradient_nodes
    from partita.passes.flops import gradient_flows

    captured = capture(gpt_tiny, [parse_input_spec("idx=int64[2,16]")], loss=default_loss)
    flows = gradient_flows(profile_model(captured).graph)
    got = gradient_nodes(captured.graph_module.graph, captured.param_nodes)
    assert got == {n for n, f in flows.items() if f} and len(got) > 50


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sends_held_is_what_the_runtime_holds_walking_the_order(schedule):
    """The sends the cost model charges a pipeline stage (core/schedule.py ``sends_held``, closed
    form) are the most the runtime holds walking the order: a forward's activations until its
    micro-batch's backward, a backward's gradients until the previous stage's activations show it
    ran that backward (``gradients_received``, as runtime/pipeline/stage.py releases them). Under a
    chunked schedule, per virtual stage: the most of that chunk's sends held at once."""
    v = chunks_of(schedule)
    for p in (2, 3, 4, 6):
        for m in (1, 2, 3, 5, 8, 13) if v == 1 else (p, 2 * p, 3 * p):
            V = p * v
            for s in range(p):
                received = gradients_received(schedule, s, p, m, v)
                forward, gradients, gone = {}, [], 0
                most_f, most_b = dict.fromkeys(range(s, V, p), 0), dict.fromkeys(range(s, V, p), 0)
                for kind, k, c in rank_order(schedule, s, p, m, v):
                    if kind == FORWARD:
                        gone = max(gone, received.get((c, k), 0))
                        if c < V - 1:
                            forward[c, k] = True
                    else:
                        forward.pop((c, k), None)
                        if c > 0:
                            gradients.append(c)
                    for c2 in most_f:
                        most_f[c2] = max(most_f[c2], sum(1 for (cc, _) in forward if cc == c2))
                        most_b[c2] = max(most_b[c2], gradients[gone:].count(c2))
                for c in most_f:
                    assert sends_held(schedule, c, V, m, v) == (most_f[c], most_b[c]), (schedule, p, m, c)
    if v == 1:
        assert sends_held(schedule, 3, 8, 10**14)[0] <= 10**14  # closed form: no walk over the micro-batches
