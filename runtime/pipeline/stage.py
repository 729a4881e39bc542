"""Pipeline parallelism: this rank's stage of the training graph, and the schedule that drives it.

``split_stages`` is the one mechanism: from the captured graph and the plan's node ->
stage map (``NodeDecision.stage``, the policy) it gives each stage the nodes it runs, the
user inputs it reads and the values that cross each cut (relayed by the stages in
between). ``PipelineStage`` runs a stage as the tensor-parallel program restricted to its
nodes (``TensorParallel`` with ``keep``), sending what crosses a cut over the "pp" group
(``isend``; receives block) and the gradients back, and sums the gradients of parameters
tied across stages. Under interleaved 1F1B a rank runs virtual stages rank, rank + p, ...
(gradients on a second group). ``schedule_order`` is a rank's order (core/schedule.py), which
the one micro-batch loop walks (runtime/step/schedule.py, shared with the one-stage path);
``infer`` streams forwards. ``apply_pipeline`` is compose's step (runtime/compose.py). The
details: docs/runtime.md, "Pipeline stages and schedules".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from partita.core.errors import PlanError
from partita.core.mesh import MeshAxis
from partita.core.model.ops import gradient_nodes, tensor_values
from partita.core.plans.plan import Plan, tied_stages
from partita.core.precision import PrecisionPolicy
from partita.core.schedule import BACKWARD, FORWARD, NONE, SCHEDULES, chunk_problem, gradients_received, rank_order
from partita.runtime.collectives import CollectiveCounter, all_gather_flat
from partita.runtime.cp.attention import ContextGroup
from partita.runtime.distributed import new_group
from partita.runtime.experts import ExpertGroup
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.step.schedule import micro_rows
from partita.runtime.tp.collectives import local_shape
from partita.runtime.tp.module import TensorParallel
from partita.runtime.trace import TraceRecorder

PP = MeshAxis.PP.value


# -- the split ---------------------------------------------------------------------


@dataclass
class StageGraph:
    """What one stage runs and what crosses its cuts (``split_stages``)."""

    index: int
    nodes: list[torch.fx.Node]  # call / output nodes it runs, in graph order
    inputs: list[tuple[int, torch.fx.Node]]  # (position among the user inputs, placeholder) it reads
    recv: list[torch.fx.Node] = field(default_factory=list)  # values from stage index - 1, in order
    send: list[torch.fx.Node] = field(default_factory=list)  # values to stage index + 1, in order


def split_stages(graph: torch.fx.Graph, stage_of: Mapping[str, int], stages: int,
                 held: Callable[[torch.fx.Node], bool]) -> list[StageGraph]:
    """Partition ``graph`` by ``stage_of`` (node name -> stage) into ``stages`` programs.

    ``held(node)`` says which placeholders are parameters or buffers (held by
    every stage that reads them, never sent). Raises ``PlanError`` for a node
    without a stage, a stage out of range, an edge that runs backwards, or an
    empty stage.
    """
    nodes = list(graph.nodes)
    for n in nodes:
        if n.name not in stage_of:
            raise PlanError(f"the plan gives no pipeline stage for node {n.format_node()}",
                            hint="recompile the plan with `partita compile`")
        if not 0 <= stage_of[n.name] < stages:
            raise PlanError(f"node {n.name} is on stage {stage_of[n.name]}, but the plan has {stages} stages",
                            hint="recompile the plan for this model with `partita compile`")
    for n in nodes:
        for u in n.users:
            if not held(n) and stage_of[u.name] < stage_of[n.name]:
                raise PlanError(f"node {u.format_node()} on stage {stage_of[u.name]} reads {n.name} from the "
                                f"later stage {stage_of[n.name]}: stages must follow the graph's order",
                                    hint="recompile the plan for this model with `partita compile`")
    out = [StageGraph(s, [], []) for s in range(stages)]
    user_inputs = [n for n in nodes if n.op == "placeholder" and not held(n)]
    for i, n in enumerate(user_inputs):
        out[stage_of[n.name]].inputs.append((i, n))
    for n in nodes:
        if n.op != "placeholder":
            out[stage_of[n.name]].nodes.append(n)
        if held(n) or not n.users:
            continue
        last = max(stage_of[u.name] for u in n.users)
        for s in range(stage_of[n.name], last):  # live across the cut after stage s
            out[s].send.append(n)
            out[s + 1].recv.append(n)
    empty = [s.index for s in out if not s.nodes]
    if empty:
        raise PlanError(f"pipeline stage(s) {empty} have no nodes to run",
                        hint="recompile the plan for this model with `partita compile`")
    return out


def schedule_order(schedule: str, stages: int, stage: int, micro_batches: int, chunks: int = 1,
                   inference: bool = False) -> list[tuple[str, int, int]]:
    """Rank ``stage``'s actions in order: ("F", k, c) forward / ("B", k, c) backward of micro-batch k
    on virtual stage c (core/schedule.py ``rank_order``, the order the planner and the viewer use too)."""
    if schedule not in SCHEDULES and not (inference and schedule == NONE):  # inference streams forwards alone
        raise PlanError(f"unknown pipeline schedule {schedule!r}; this runtime runs {', '.join(SCHEDULES)}",
                        hint="recompile the plan for this model with `partita compile`")
    problem = chunk_problem(schedule, stages, chunks, micro_batches)
    if problem:
        raise PlanError(f"the plan's pipeline cannot run: {problem}",
                        hint="recompile the plan for this model with `partita compile`")
    return [("F" if a == FORWARD else "B", k, c)
            for a, k, c in rank_order(schedule, stage, stages, micro_batches, chunks, inference)]


def _rebuild(meta: Any, values: Iterable[torch.Tensor]) -> Any:
    """``meta``'s structure (a tensor, or nested tuples / lists) with its tensors replaced in order."""
    return _fill(meta, iter(values))


def _fill(v: Any, it: Iterator[torch.Tensor]) -> Any:
    # A module-level function, not a closure calling itself: that closure would be a reference
    # cycle holding the received tensors until the garbage collector runs.
    if isinstance(v, torch.Tensor):
        return next(it)
    if isinstance(v, (tuple, list)):
        return type(v)(_fill(x, it) for x in v)
    return v


# -- one stage ---------------------------------------------------------------------


class Tie(NamedTuple):
    """A parameter held on several stages: this stage's copy and the group of all its copies."""

    name: str
    param: nn.Parameter
    group: dist.ProcessGroup
    ranks: tuple[int, ...]  # one per stage holding it


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""

    sent: list[torch.Tensor]  # outputs that carry a gradient, in the order gradients arrive
    received: list[torch.Tensor]  # inputs that carry a gradient, in the order gradients are sent back
    loss: torch.Tensor | None = None


class PipelineStage(nn.Module):
    """This rank's stage: its TP program over the stage's nodes, its neighbours, its schedule."""

    def __init__(self, module: nn.Module, plan: Plan, mesh: Any, *, loss_fn: Callable | None,
                 counter: CollectiveCounter, device: torch.device, precision: PrecisionPolicy,
                 rng: tuple[int, int] | None, weights: str | Path | None = None, compile: bool = False,
                 experts: ExpertGroup | None = None, context: ContextGroup | None = None) -> None:
        super().__init__()
        self.plan, self.counter, self.device = plan, counter, device
        p = plan.mesh.pp
        self.chunks, virtual = plan.training.chunks, plan.virtual_stages
        self.pp_group = mesh[PP].get_group()
        self.index = dist.get_rank(self.pp_group)
        self.num_stages = p
        self.rank = dist.get_rank()
        stage_of = {d.name: d.stage for d in plan.nodes}
        self.mine = list(range(self.index, virtual, p))  # this rank's virtual stages (chunks)
        for c in self.mine:
            if plan.stages and len(plan.stages) == virtual and plan.stages[c].ranks \
                    and self.rank not in plan.stages[c].ranks:
                raise PlanError(f"rank {self.rank} is on pipeline stage {c} by the mesh order "
                                f"(pp outermost), but the plan lists stage {c}'s ranks as "
                                f"{list(plan.stages[c].ranks)}",
                                hint="recompile the plan for this model with `partita compile`")
        tp_group = mesh[MeshAxis.TP.value].get_group() if plan.mesh.tp > 1 else None
        self.tp = TensorParallel(module, plan, tp_group, loss_fn=loss_fn, counter=counter, device=device,
                                 weights=weights, keep=lambda n: stage_of.get(n.name, -1) % p == self.index,
                                 precision=precision, rng=rng, compile=compile, experts=experts,
                                 context=context)
        graph = self.tp.graph_module.graph
        held = lambda n: n.name in self.tp.param_nodes or n.name in self.tp.buffer_nodes
        self.stages = split_stages(graph, stage_of, virtual, held)
        self.grad_nodes = gradient_nodes(graph, self.tp.param_nodes)  # the planner's rule (core/model/ops.py)
        # gradients go back on a group of their own when chunks wrap around the ranks: with p = 2 a
        # rank's neighbours are one rank, to which activations and gradients both go
        self.grad_group = self._line_group(range(p))[0] if self.chunks > 1 else self.pp_group
        self.held = [n for n in graph.nodes if n.op == "placeholder" and self.tp.holds(n)]
        self._held_values = [self.tp.placeholder_value(n, None) for n in self.held]
        # each chunk's program: the parameters and buffers, its user inputs, what it receives -> what it
        # sends (the last virtual stage: the graph's output)
        self._io = {c: ([*self.held, *(n for _, n in self.stages[c].inputs), *self.stages[c].recv],
                        [self.stages[c].nodes[-1]] if c == virtual - 1 else list(self.stages[c].send))
                    for c in self.mine}
        self.trace = TraceRecorder(self.rank, self.index)
        self.ties = self._tie_groups(stage_of)
        self._inflight: dict[tuple[int, int], _InFlight] = {}  # (chunk, micro-batch) -> its state
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []  # sent without gradients (evaluation, inference)
        # (chunk, micro-batch) -> its activations sent; its gradients sent, in the order sent
        self._forward_sends: dict[tuple[int, int], list[tuple[dist.Work, torch.Tensor]]] = {}
        self._backward_sends: list[list[tuple[dist.Work, torch.Tensor]]] = []
        self._backward_released = 0  # how many of ``_backward_sends`` are let go
        # (chunk, micro-batch) -> gradients the previous rank has had by that forward's receive
        self._received_by_prev: dict[tuple[int, int], int] = {}

    @property
    def is_last(self) -> bool:  # this rank runs the last (virtual) stage, which computes the loss
        return self.index == self.num_stages - 1

    @property
    def reads(self) -> frozenset[int]:
        """The user inputs this rank's chunks read (positions among the inputs, the targets last):
        the others never reach it, or come from the previous stage as activations."""
        return frozenset(i for c in self.mine for i, _ in self.stages[c].inputs)

    def _peer(self, chunk: int) -> int:  # the global rank running virtual stage ``chunk`` (pp rank chunk mod p)
        return dist.get_global_rank(self.pp_group, chunk % self.num_stages)

    def _line_group(self, stages: Iterable[int]) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
        """A new group over pipeline ranks ``stages`` of every (dp, tp) line of the mesh (every rank
        creates every one, in one order: ``new_group`` is collective): this rank's line's group and
        its ranks, or None and () if this rank is on none of ``stages``."""
        m, stages, out = self.plan.mesh, list(stages), (None, ())
        for dp in range(m.dp):
            for tp in range(m.tp):
                ranks = tuple(m.rank(pp=s, dp=dp, tp=tp) for s in stages)
                group = new_group("pipeline line", ranks)
                if self.rank in ranks:
                    out = (group, ranks)
        return out

    def local_parameters(self) -> dict[str, tuple[nn.Parameter, str]]:
        return self.tp.local_parameters()

    # -- tied parameters ---------------------------------------------------------

    def _tie_groups(self, stage_of: Mapping[str, int]) -> list[Tie]:
        """A ``Tie`` for each parameter held on several stages, by name: the plan's stage map and
        the graph decide it (``tied_stages``), so every stage derives the same list in the same
        order. Every rank creates every group, in that order (``new_group`` is collective)."""
        graph = self.tp.graph_module.graph
        param_nodes = self.tp.param_nodes
        readers = {n.name: [u.name for u in n.users] for n in graph.nodes if n.name in param_nodes}
        local, out = self.local_parameters(), []
        for q, holders in tied_stages(param_nodes, readers, stage_of, pp=self.plan.mesh.pp).items():
            group, ranks = self._line_group(holders)
            if group is not None:
                out.append(Tie(q, local[q][0], group, ranks))
        return out

    @property
    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of the parameters it shares with other stages."""
        return [t.param for t in self.ties]

    def sync_tied(self) -> None:
        """Sum the gradients of tied copies over the stages holding them (after dp averaging).

        Every holder takes part every step, whether or not its copy received a gradient (a copy
        whose stage's nodes gave it none contributes zeros): skipping the call on one stage
        would leave the others waiting in it."""
        for _, param, group, ranks in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.counter.record("all_reduce", PP, param.grad.numel() * param.grad.element_size(), ranks)
            with self.counter.blocking("all_reduce", PP):
                dist.all_reduce(param.grad, group=group)

    # -- point to point ------------------------------------------------------------

    def _wire(self, nodes: list[torch.fx.Node], grads_only: bool) -> list[tuple[torch.fx.Node, Any, str]]:
        """(node, meta value, placement) of each tensor crossing with ``nodes``, in wire order."""
        out = []
        for n in nodes:
            placements = self.tp.decisions[n.name].out
            for v, placement in zip(tensor_values(n.meta.get("val")), placements):
                if not grads_only or (n.name in self.grad_nodes and v.dtype.is_floating_point):
                    out.append((n, v, placement))
        return out

    def _send(self, values: list[torch.Tensor], dst: int, held: list[tuple[dist.Work, torch.Tensor]] | None = None,
              group: dist.ProcessGroup | None = None) -> None:
        """Send ``values`` to ``dst``, holding each tensor in ``held`` until it is let go (``_release_sent``)."""
        held = self._sends if held is None else held
        for t in values:
            t = t.detach().contiguous()
            self.counter.record("send_recv", PP, t.numel() * t.element_size())
            held.append((dist.isend(t, dst=dst, group=group or self.pp_group), t))

    def _recv(self, wire: list[tuple[torch.fx.Node, Any, str]], src: int,
              group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        dtype = self.tp.precision.held_dtype  # floating activations cross in the compute dtype (``_send``'s)
        bufs = [torch.empty(local_shape(v.shape, placement, self.tp.tp.size), dtype=dtype(v.dtype), device=self.device)
                for _, v, placement in wire]
        FLIGHT.entered("recv", PP, sum(b.numel() * b.element_size() for b in bufs), tuple(sorted((src, self.rank))))
        works = [dist.irecv(b, src=src, group=group or self.pp_group) for b in bufs]
        with self.counter.blocking("send_recv", PP):
            for w in works:
                w.wait()
        return bufs

    @staticmethod
    def _let_go(sends: list[tuple[dist.Work, torch.Tensor]]) -> None:
        """Let go of sends the peer has received: a forward's activations once its gradients came
        back, a backward's gradients once the previous rank's activations show it ran those
        backwards (core/schedule.py ``gradients_received``). The waits return at once (gloo's works
        say they are complete only once waited on); a sent tensor is held while on the wire, not to
        the step's end."""
        for work, _ in sends:
            work.wait()
        sends.clear()

    def _release_gradients(self, count: int) -> None:
        """Let go of the first ``count`` gradient sends (the previous rank has received them)."""
        while self._backward_released < min(count, len(self._backward_sends)):
            self._let_go(self._backward_sends[self._backward_released])
            self._backward_released += 1

    def wait_sends(self) -> None:
        for sends in self._forward_sends.values():
            self._let_go(sends)
        self._forward_sends.clear()
        self._release_gradients(len(self._backward_sends))
        self._backward_sends.clear()
        self._backward_released = 0
        self._let_go(self._sends)

    # -- one micro-batch -------------------------------------------------------------

    def forward_micro(self, k: int, inputs: list[torch.Tensor], *, grad: bool = True, chunk: int | None = None
                      ) -> Any:
        """Forward of micro-batch ``k`` on virtual stage ``chunk`` (default: this rank's first;
        ``inputs``: its user inputs, targets last); returns the last stage's output (the loss in
        training), None elsewhere."""
        c = self.index if chunk is None else chunk
        g, last = self.stages[c], c == len(self.stages) - 1
        values = [*self._held_values, *(self.tp.placeholder_value(n, inputs[i]) for i, n in g.inputs)]
        received: list[torch.Tensor] = []
        if g.recv:
            wire = self._wire(g.recv, grads_only=False)
            got = self._recv(wire, self._peer(c - 1))
            for (n, v, _), t in zip(wire, got):
                if grad and n.name in self.grad_nodes and v.dtype.is_floating_point:
                    t.requires_grad_(True)
                    received.append(t)
            it = iter(got)
            values += [_rebuild(n.meta.get("val"), it) for n in g.recv]
            self._release_gradients(self._received_by_prev.get((c, k), 0))
        inputs_, outputs = self._io[c]
        with self.trace.span(FORWARD, k, c), torch.set_grad_enabled(grad):
            results = self.tp.run(f"stage {c}", g.nodes, inputs_, outputs, values)
        if last:
            out = results[0]
            out = out[-1] if isinstance(out, (tuple, list)) and len(out) == 1 else out
            if grad:
                self._inflight[c, k] = _InFlight([], received, out)
            return out
        # in the compute dtype (what the plan prices), a differentiable cast: the gradient comes back in it
        outs = [self.tp.precision.wire(t) for value in results for t in tensor_values(value)]
        self._send(outs, self._peer(c + 1), self._forward_sends.setdefault((c, k), []) if grad else None)
        if grad:
            sent = [t for (n, v, _), t in zip(self._wire(g.send, grads_only=False), outs)
                    if n.name in self.grad_nodes and v.dtype.is_floating_point]
            self._inflight[c, k] = _InFlight(sent, received)
        return None

    def backward_micro(self, k: int, scale: float, chunk: int | None = None) -> None:
        """Backward of micro-batch ``k`` on virtual stage ``chunk`` (default: this rank's first):
        from ``loss * scale`` on the last stage, else from the gradients the next stage sends back;
        then the inputs' gradients go to the previous stage."""
        c = self.index if chunk is None else chunk
        f = self._inflight.pop((c, k))
        if c == len(self.stages) - 1:
            with self.trace.span(BACKWARD, k, c):
                (f.loss * scale).backward()
        else:
            grads = self._recv(self._wire(self.stages[c].send, grads_only=True), self._peer(c + 1), self.grad_group)
            self._let_go(self._forward_sends.pop((c, k), []))  # the next stage had k's activations: sent
            pairs = [(t, g) for t, g in zip(f.sent, grads) if t.requires_grad]
            with self.trace.span(BACKWARD, k, c):
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if c > 0:
            sends: list[tuple[dist.Work, torch.Tensor]] = []
            self._send([t.grad if t.grad is not None else torch.zeros_like(t) for t in f.received], self._peer(c - 1),
                       sends, self.grad_group)
            self._backward_sends.append(sends)

    # -- a step (run by runtime/step/schedule.py's micro-batch loop) -----------------

    def schedule(self, micro_batches: int, *, training: bool) -> list[tuple[str, int, int]]:
        """This rank's actions for a step (the plan's schedule; forwards alone unless ``training``),
        and for training which gradients the previous rank has had by each forward's receive."""
        tr = self.plan.training
        if training:
            self._received_by_prev = gradients_received(tr.schedule, self.index, self.num_stages, micro_batches,
                                                        self.chunks)
        return schedule_order(tr.schedule, self.num_stages, self.index, micro_batches, self.chunks,
                              inference=not training)

    def end_schedule(self, *, training: bool) -> None:
        """After the rank's last action: tied copies' gradients summed (training), the sends let go."""
        if training:
            self.sync_tied()
        self.wait_sends()

    def mean(self, loss_sum: torch.Tensor, micro_batches: int, dp_group: dist.ProcessGroup | None) -> float:
        """The step's mean loss: the last stage's, averaged over "dp" and broadcast over "pp"."""
        loss = loss_sum.div_(micro_batches)
        if self.is_last and dp_group is not None:
            self.counter.record("all_reduce", MeshAxis.DP.value, loss.element_size())
            loss.div_(dist.get_world_size(dp_group))
            dist.all_reduce(loss, group=dp_group)
        self.counter.record("broadcast", PP, loss.element_size())
        with self.counter.blocking("broadcast", PP):
            dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, self.num_stages - 1), group=self.pp_group)
        return float(loss)

    # -- inference -------------------------------------------------------------------

    @torch.no_grad()
    def infer(self, xs: list[torch.Tensor], dp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """The model's output for this rank's share ``xs``, streamed as micro-batches; gathered over
        "dp" and broadcast over "pp", so every rank returns the output for the whole batch."""
        tr = self.plan.training
        mbs = tr.micro_batch_size
        m = tr.global_batch // (dist.get_world_size(dp_group) if dp_group is not None else 1) // mbs
        outs = []
        for _, k, c in schedule_order(tr.schedule, self.num_stages, self.index, m, self.chunks, inference=True):
            out = self.forward_micro(k, micro_rows(xs, k, mbs), grad=False, chunk=c)
            if out is not None:
                outs.append(out)
        last = self.stages[-1].nodes[-1]  # the output node: its input's placement, at the micro-batch shape
        (meta,) = [a.meta["val"] for a in last.all_input_nodes]
        shape = local_shape(meta.shape, self.tp.decisions[last.name].ins[0].need, self.tp.tp.size)
        result = torch.cat(outs) if outs else torch.empty((m * shape[0], *shape[1:]), dtype=meta.dtype,
                                                          device=self.device)
        self.wait_sends()
        self.counter.record("broadcast", PP, result.numel() * result.element_size())
        dist.broadcast(result, src=dist.get_global_rank(self.pp_group, self.num_stages - 1), group=self.pp_group)
        if dp_group is not None:
            whole = result.new_empty((result.shape[0] * dist.get_world_size(dp_group), *result.shape[1:]))
            self.counter.record("all_gather", MeshAxis.DP.value, whole.numel() * whole.element_size())
            all_gather_flat(whole, result.contiguous(), group=dp_group)
            result = whole
        return result


def apply_pipeline(module: nn.Module, plan: Plan, mesh: Any, *, loss_fn: Callable | None,
                   counter: CollectiveCounter, device: torch.device, precision: PrecisionPolicy,
                   rng: tuple[int, int] | None, weights: str | Path | None = None,
                   compile: bool = False, experts: ExpertGroup | None = None,
                   context: ContextGroup | None = None) -> PipelineStage:
    """Compose's pipeline step: this rank's stage, the TP program over the stage's nodes (tensor
    parallelism inside it, over "tp" when tp > 1; its MoE layers' experts split over ``experts``
    when given), linked to its neighbours over "pp"."""
    return PipelineStage(module, plan, mesh, loss_fn=loss_fn, counter=counter, device=device,
                         precision=precision, rng=rng, weights=weights, compile=compile, experts=experts,
                         context=context)
