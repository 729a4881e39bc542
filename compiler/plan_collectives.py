"""The collectives a plan lists: what each rank is expected to run per step, and its predicted time.

Reads the decision the search made and the per-node / per-parameter layouts
``compile.build_plan`` packed; returns ``Collective`` records by axis: the
data-parallel gradient buckets (or ZeRO's collectives) and loss average, each
stage's tensor-parallel collectives, the pipeline's point-to-point sends and
loss broadcast, the all-reduce of parameters tied across stages, and under expert
parallelism the all-to-alls over "ep" and the experts' gradient buckets over "edp"
(passes/experts.py), under context parallelism the ring's sends or the all-to-alls around each
attention core over "cp" (passes/context.py). Every link comes from the mesh's rank layout (core/mesh.py via
``ClusterSpec``), the one the planner priced the decision on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from partita.core.buckets import unit_of
from partita.core.cluster import ClusterSpec
from partita.core.mesh import Mesh, MeshAxis
from partita.core.model.capture import CapturedModel
from partita.core.model.ops import running_buffers
from partita.core.pins import TrainingRequest
from partita.core.placement import is_shard
from partita.core.plans.plan import Collective, ParamDecision
from partita.core.precision import activation_scale, dtype_bytes, element_bytes
from partita.core.recompute import FULL, NONE, rerun_regions
from partita.core.tp.layout import forward_collectives, recompute_collectives, tp_collectives
from partita.passes.context import context_calls, context_profile
from partita.passes.cost_model import collective_time, padded_bucket, zero_collectives
from partita.passes.dp.buckets import gradient_buckets
from partita.passes.experts import all_to_alls, expert_links, model_experts
from partita.passes.profile import ModelProfile
from partita.passes.search import Decision


def plan_collectives(captured: CapturedModel, params: Sequence[ParamDecision], nodes: Sequence[Any],
                     tied: Mapping[str, tuple[int, ...]], d: Decision, cluster: ClusterSpec,
                     request: TrainingRequest, zero_units: Sequence[str] = (), *,
                     profile: ModelProfile | None = None) -> tuple[Collective, ...]:
    """Every collective of the plan: data parallel, tensor parallel, pipeline, tied parameters, experts.
    ``zero_units``: ZeRO-3's units (core/buckets.py), the plan's ``Training.zero_units``; ``profile``:
    the model's, whose MoE layers (passes/experts.py) an ep > 1 plan's all-to-alls are of."""
    return (_dp_collectives(params, tied, d, cluster, request, zero_units)
            + _tp_plan_collectives(nodes, d, cluster, inference=request.inference, captured=captured)
            + _pp_collectives(captured, nodes, d, cluster, request)
            + _tied_collectives(params, tied, d, cluster, request)
            + _buffer_collectives(captured, nodes, d, cluster, request)
            + _ep_collectives(profile, nodes, d, cluster, request)
            + _cp_collectives(profile, nodes, d, cluster, request))


def _expert(p: ParamDecision) -> bool:
    """Whether ``p`` is sharded by expert over "ep" (its gradient averaged over "edp", not "dp")."""
    return is_shard(p.layout.get(MeshAxis.EP.value, "replicate"))


def _local_numel(p: ParamDecision, mesh: Mesh) -> int:
    """Elements of ``p`` one rank holds: its shard over "tp" and over "ep", else all of it."""
    sharded = is_shard(p.layout.get(MeshAxis.TP.value, "replicate"))
    return math.prod(p.shape) // (mesh.tp if sharded else 1) // (mesh.ep if _expert(p) else 1)


def _tied_collectives(params: Sequence[ParamDecision], tied: Mapping[str, tuple[int, ...]], d: Decision,
                      cluster: ClusterSpec, request: TrainingRequest) -> tuple[Collective, ...]:
    """The tied-gradient all-reduce of each parameter held on several stages, listed for every
    stage that takes part (runtime/pipeline/stage.py ``sync_tied``)."""
    if request.inference:
        return ()
    grad_bytes = element_bytes(request.precision)
    by_name = {p.name: p for p in params}
    links = cluster.stage_links(d.mesh)
    out = []
    for name, stages in tied.items():
        nbytes = _local_numel(by_name[name], d.mesh) * grad_bytes
        link = min(links[stages[0]:stages[-1]], key=lambda ln: ln.bandwidth)
        for s in stages:
            out.append(Collective(kind="all_reduce", axis=MeshAxis.PP.value, bytes=nbytes, count=1,
                                  group_size=len(stages), purpose=f"gradient of {name}, shared by stages "
                                  f"{', '.join(map(str, stages))} (summed between its copies)",
                                  seconds=collective_time("all_reduce", nbytes, len(stages), link), stage=s))
    return tuple(out)


def _dp_collectives(params: Sequence[ParamDecision], tied: Mapping[str, tuple[int, ...]], d: Decision,
                    cluster: ClusterSpec, request: TrainingRequest, zero_units: Sequence[str] = ()
                    ) -> tuple[Collective, ...]:
    """Gradient buckets of each stage's local parameters over its dp group, and the loss average.
    A parameter tied across stages is a local parameter of every stage holding it. The experts of
    an ep > 1 plan are bucketed apart, over the ranks holding the same experts ("edp")."""
    dp = d.mesh.dp
    if dp <= 1 or request.inference:
        return ()
    link = cluster.link_for_group(dp, stride=d.mesh.tp)
    grad_bytes = element_bytes(request.precision)  # gradients are held in the compute dtype
    reduce = dtype_bytes(request.reduce_dtype)  # and sent in the reduce dtype (core/precision.py)
    out: list[Collective] = []
    for s in range(d.mesh.pp):
        mine = [p for p in params if s in tied.get(p.name, (p.stage % d.mesh.pp,)) and not _expert(p)]  # by rank
        # under ZeRO a parameter tied across stages stays whole and is averaged as in plain DP
        # (runtime/engine.py): its copies' stages lay their ZeRO buckets out differently
        whole = [p for p in mine if p.name in tied] if d.zero_stage else []
        sharded = [p for p in mine if p not in whole]
        by_call: dict[tuple[str, int, str], int] = {}
        for zero_stage, group in ((d.zero_stage, sharded), (0, whole)):
            local = [_local_numel(p, d.mesh) for p in group]
            units = [unit_of(p.name, zero_units) for p in group] if zero_stage == 3 and zero_units else None
            for b in gradient_buckets(local, grad_bytes, d.bucket_bytes, units):
                if zero_stage == 0:
                    key = ("all_reduce", b * reduce // grad_bytes,
                           f"gradient averaging in {request.reduce_dtype} (one bucket per call, after the last "
                           "micro-batch)")
                    by_call[key] = by_call.get(key, 0) + 1
                    continue
                padded = round(padded_bucket(b, dp, grad_bytes))  # ZeRO's flat buckets split evenly over dp
                for kind, calls, what in zero_collectives(zero_stage, d.grad_accum_steps):
                    # gradients are sent in the reduce dtype
                    size = padded * reduce // grad_bytes if what == "grads" else padded
                    how = (f"reduce-scatter of gradients in {request.reduce_dtype}" if what == "grads"
                           else "all-gather of parameters")
                    key = (kind, size, f"ZeRO-{zero_stage} {what} ({how})")
                    by_call[key] = by_call.get(key, 0) + calls
        out += [Collective(kind=kind, axis=MeshAxis.DP.value, bytes=size, count=count, group_size=dp,
                           purpose=purpose, seconds=count * collective_time(kind, size, dp, link),
                           stage=s if d.mesh.pp > 1 else None)
                for (kind, size, purpose), count in by_call.items()]
    edp = dp // d.mesh.ep
    if edp > 1:  # each stage's expert slices, over the ranks holding the same experts (passes/experts.py)
        edp_link = expert_links(cluster, dp=dp, tp=d.mesh.tp, ep=d.mesh.ep)[1]
        for s in range(d.mesh.pp):
            local = [_local_numel(p, d.mesh) for p in params if _expert(p) and p.stage % d.mesh.pp == s]
            by_size: dict[int, int] = {}
            for b in gradient_buckets(local, grad_bytes, d.bucket_bytes):
                by_size[b * reduce // grad_bytes] = by_size.get(b * reduce // grad_bytes, 0) + 1
            out += [Collective(kind="all_reduce", axis=MeshAxis.EDP.value, bytes=size, count=count, group_size=edp,
                               purpose=f"expert gradient averaging in {request.reduce_dtype} over the ranks holding "
                               "the same experts (one bucket per call, after the last micro-batch)",
                               seconds=count * collective_time("all_reduce", size, edp, edp_link),
                               stage=s if d.mesh.pp > 1 else None)
                    for size, count in by_size.items()]
    last = d.mesh.pp - 1
    out.append(Collective(kind="all_reduce", axis=MeshAxis.DP.value, bytes=4, count=1, group_size=dp,
                          purpose="loss averaging (the step's loss, same on every rank)",
                          seconds=collective_time("all_reduce", 4, dp, link), stage=last if last else None))
    return tuple(out)


def _buffer_collectives(captured: CapturedModel, nodes: Sequence[Any], d: Decision, cluster: ClusterSpec,
                        request: TrainingRequest) -> tuple[Collective, ...]:
    """The running statistics a training forward writes (batch norm's), averaged over "dp" after
    each step: one all-reduce per dtype per stage (runtime/dp/averaging.py ``BufferAverager``)."""
    dp = d.mesh.dp
    written = running_buffers(captured.graph_module.graph, captured.buffer_nodes)
    if dp <= 1 or request.inference or not written:
        return ()
    link = cluster.link_for_group(dp, stride=d.mesh.tp)
    readers = {lay.src: n.stage for n in nodes for lay in n.ins if lay.src in written}
    by_call: dict[tuple[int, str], int] = {}
    for node, (numel, dtype) in written.items():
        key = (readers.get(node, 0), str(dtype).removeprefix("torch."))
        by_call[key] = by_call.get(key, 0) + numel * dtype_bytes(key[1])
    return tuple(Collective(kind="all_reduce", axis=MeshAxis.DP.value, bytes=nbytes, count=1, group_size=dp,
                            purpose=f"running statistics (batch norm's) averaged over dp, in {dt}",
                            seconds=collective_time("all_reduce", nbytes, dp, link),
                            stage=s if d.mesh.pp > 1 else None)
                 for (s, dt), nbytes in sorted(by_call.items()))


def _tp_plan_collectives(nodes: Sequence[Any], d: Decision, cluster: ClusterSpec, *,
                         inference: bool = False, captured: CapturedModel) -> tuple[Collective, ...]:
    """Each stage's TP collectives of one micro-batch (tp_collectives; the forward's alone for an
    inference plan), times the micro-batches."""
    tp = d.mesh.tp
    if tp <= 1:
        return ()
    link = cluster.link_for_group(tp)
    out: list[Collective] = []
    # the nodes that rerun in backward (core/recompute.py): their forward collectives run again
    rerun = rerun_regions(d.stages, nodes, captured.graph_module.graph.nodes,
                          {*captured.param_nodes, *captured.buffer_nodes})
    for s in range(d.mesh.pp * d.chunks):  # (virtual) stages
        mine = [n for n in nodes if n.stage == s]
        listed = forward_collectives(mine) if inference else tp_collectives(mine, sequence_parallel=d.sequence_parallel)
        if any(n.name in rerun for n in mine):
            listed += recompute_collectives([n for n in mine if n.name in rerun])
        out += [Collective(kind=kind, axis=MeshAxis.TP.value, bytes=nbytes, count=calls * d.grad_accum_steps,
                           group_size=tp, purpose=purpose,
                           seconds=calls * d.grad_accum_steps * collective_time(kind, nbytes, tp, link),
                           stage=s if d.mesh.pp > 1 else None)
                for kind, nbytes, calls, purpose in listed]
    return tuple(out)


def _pp_collectives(captured: CapturedModel, nodes: Sequence[Any], d: Decision, cluster: ClusterSpec,
                    request: TrainingRequest) -> tuple[Collective, ...]:
    """Point-to-point sends between neighbouring stages: every tensor live across a cut, forward per
    micro-batch, and its gradient back when it carries one (relayed through the stages in between).
    Parameters and buffers never cross: each stage reading one holds it (tied copies)."""
    if d.mesh.pp <= 1:
        return ()
    stage = {n.name: n.stage for n in nodes}
    held = captured.param_nodes.keys() | captured.buffer_nodes.keys()
    # each tensor crosses each cut once, however many nodes of later stages read it
    crossing: dict[tuple[int, str, int], tuple[int, bool]] = {}  # (cut, src, index) -> (local bytes, carries grad)
    for n in nodes:
        for lay in n.ins:
            if lay.src in held:
                continue
            lo, hi = stage[lay.src], n.stage
            nbytes = lay.bytes // (d.mesh.tp if is_shard(lay.have) else 1)
            for s in range(lo, hi):
                grad = crossing.get((s, lay.src, lay.index), (0, False))[1] or lay.grad != "none"
                crossing[(s, lay.src, lay.index)] = (nbytes, grad)
    sends: dict[tuple[int, str, int], int] = {}  # (sending stage, direction, bytes) -> tensors per micro-batch
    for (s, _src, _index), (nbytes, grad) in crossing.items():
        sends[(s, "forward", nbytes)] = sends.get((s, "forward", nbytes), 0) + 1
        if grad and not request.inference:
            sends[(s + 1, "backward", nbytes)] = sends.get((s + 1, "backward", nbytes), 0) + 1
    if request.inference:  # runtime/pipeline/stage.py ``infer``: the whole output to every stage
        out_bytes = d.grad_accum_steps * sum(lay.bytes for n in nodes if n.op == "output" for lay in n.ins)
        out = [Collective(kind="broadcast", axis=MeshAxis.PP.value, bytes=out_bytes, count=1, group_size=d.mesh.pp,
                          purpose="the output from the last stage to every stage",
                          seconds=collective_time("broadcast", out_bytes, d.mesh.pp,
                                                  cluster.link_for_axis(d.mesh, MeshAxis.PP.value)))]
    else:
        out = [Collective(kind="broadcast", axis=MeshAxis.PP.value, bytes=4, count=1, group_size=d.mesh.pp,
                          purpose="the step's loss from the last stage to every stage",
                          seconds=collective_time("broadcast", 4, d.mesh.pp,
                                                  cluster.link_for_axis(d.mesh, MeshAxis.PP.value)))]
    links = cluster.stage_links(d.mesh, d.chunks)  # the planner's: its cuts were priced on them
    for (s, direction, nbytes), count in sorted(sends.items()):
        link = links[s if direction == "forward" else s - 1]
        calls = count * d.grad_accum_steps
        out.append(Collective(kind="send_recv", axis=MeshAxis.PP.value, bytes=nbytes, count=calls, group_size=2,
                              purpose=("activation to the next stage" if direction == "forward"
                                       else "gradient to the previous stage"),
                              seconds=calls * collective_time("send_recv", nbytes, 2, link), stage=s))
    return tuple(out)




def _ep_collectives(profile: ModelProfile | None, nodes: Sequence[Any], d: Decision, cluster: ClusterSpec,
                    request: TrainingRequest) -> tuple[Collective, ...]:
    """Each micro-batch's all-to-alls over the expert groups of an ep > 1 plan (passes/experts.py
    ``all_to_alls``: the counts, the dispatch and the combine of each MoE layer, in backward the
    last two reversed, and a whole-layer recomputation's forward again), times the micro-batches,
    listed for the stage running the layer's first grouped matmul."""
    ep = d.mesh.ep
    if ep <= 1 or profile is None:
        return ()
    link = expert_links(cluster, dp=d.mesh.dp, tp=d.mesh.tp, ep=ep)[0]
    stage = {n.name: n.stage for n in nodes}
    out: list[Collective] = []
    for s in range(d.mesh.pp * d.chunks):  # (virtual) stages
        regions = [r for r in model_experts(profile.graph) if stage.get(r.first, 0) == s]
        recompute = bool(d.stages) and d.stages[s].recompute == FULL
        calls = all_to_alls(regions, d.micro_batch_size, profile.batch_size,
                            activation_scale(request.precision, profile.param_dtype), inference=request.inference,
                            recompute=recompute)
        out += [Collective(kind="all_to_all", axis=MeshAxis.EP.value, bytes=c.nbytes,
                           count=c.calls * d.grad_accum_steps, group_size=ep, purpose=c.purpose,
                           seconds=c.calls * d.grad_accum_steps * collective_time("all_to_all", c.nbytes, ep, link),
                           stage=s if d.mesh.pp > 1 else None)
                for c in calls]
    return tuple(out)


def _cp_collectives(profile: ModelProfile | None, nodes: Sequence[Any], d: Decision, cluster: ClusterSpec,
                    request: TrainingRequest) -> tuple[Collective, ...]:
    """Each micro-batch's exchanges around the attention cores of a cp > 1 plan over "cp"
    (passes/context.py ``context_calls``: the ring's cp - 1 sends forward and backward, or four
    all-to-alls each way; a recomputing stage's forward again), times the micro-batches, listed for
    the (virtual) stage running each core."""
    cp = d.mesh.cp
    if cp <= 1 or profile is None:
        return ()
    stage = {n.name: n.stage for n in nodes}
    core_stage = {a["attention_core"]: stage.get(n, 0) for n, a in reversed(list(profile.graph.nodes(data=True)))
                  if a.get("attention_core")}
    view = context_profile(profile, cp)
    out: list[Collective] = []
    for s in range(d.mesh.pp * d.chunks):
        rerun = bool(d.stages) and d.stages[s].recompute != NONE
        calls = context_calls(view, request, cluster, cp=cp, tp=d.mesh.tp, micro_batch=d.micro_batch_size,
                              strategy=d.cp_attention, held=lambda core, s=s: core_stage.get(core, 0) == s,
                              recompute=rerun)
        out += [Collective(kind=kind, axis=MeshAxis.CP.value, bytes=round(size), count=n * d.grad_accum_steps,
                           group_size=cp, purpose=purpose, seconds=n * d.grad_accum_steps * one,
                           stage=s if d.mesh.pp > 1 else None)
                for kind, size, n, purpose, one in calls]
    return tuple(out)
