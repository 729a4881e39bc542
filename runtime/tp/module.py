"""Tensor parallelism: a plan's node decisions run on this rank with local tensors.

``TensorParallel`` captures the training graph (model + loss) itself, keeps only
this rank's shard of every parameter (runtime/state/weights.py ``load_local``), and
runs the graph's nodes as this rank's program over LOCAL tensors, generated once per
node list and mode (runtime/tp/program.py: each input resharded as the plan says by
runtime/tp/collectives.py, a few ops through local programs of
runtime/tp/local_ops.py, recomputed layers per runtime/tp/recompute.py).

The same program is a pipeline stage's (``keep``: the stage's nodes; it then
holds only the parameters they read) and, at tp = 1, the program of a plan that
recomputes activations (a one-rank TP group). ``apply_tensor_parallel`` is the
step of compose (runtime/compose.py) that builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from partita.core.errors import PlanError
from partita.core.experts import expert_params, expert_regions
from partita.core.model.capture import CapturedModel, capture
from partita.core.model.inputs import InputSpec, parse_input_spec
from partita.core.plans.plan import Plan
from partita.core.plans.verify import check_layouts
from partita.core.precision import FP32, PrecisionPolicy
from partita.runtime.collectives import CollectiveCounter
from partita.runtime.cp.attention import ContextGroup
from partita.runtime.cp.program import ContextParallel
from partita.runtime.experts import ExpertGroup, ExpertLayers
from partita.runtime.state.weights import load_local, open_weights
from partita.runtime.tp.collectives import TPGroup
from partita.runtime.tp.program import ParamAccess, Program, build_program
from partita.runtime.tp.recompute import RegionCache


def _aliases(op: Any) -> bool:
    """Whether an aten op's output may be a view of its input (t, view, permute, slice...)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


class TensorParallel(nn.Module):
    """This rank's part of a tensor-parallel plan: local parameter shards and the local program.

    ``forward(*inputs, targets)`` runs one micro-batch (inputs and targets whole,
    replicated on the TP group) and returns the loss, equal on every TP rank.
    Parameters come from ``module`` (its real weights are sliced, then the module's
    tensors move to the meta device) or, when ``weights`` is given, from a
    ``torch.save``d state dict read with ``mmap=True`` so only each slice is read:
    ``module`` may then live on the meta device. The forward runs under
    ``precision``'s autocast; random ops are seeded per op from ``rng``
    ((run seed, dp rank), runtime/rng.py) when given.
    """

    def __init__(self, module: nn.Module, plan: Plan, group: dist.ProcessGroup | None, *,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, counter: CollectiveCounter,
                 device: torch.device, weights: str | Path | None = None,
                 keep: Callable[[torch.fx.Node], bool] | None = None,
                 precision: PrecisionPolicy = FP32, rng: tuple[int, int] | None = None,
                 compile: bool = False, experts: ExpertGroup | None = None,
                 context: ContextGroup | None = None) -> None:
        super().__init__()
        self.tp = TPGroup(group, counter)
        self.plan = plan
        self.device = device
        self.precision = precision
        self.sequence_parallel = plan.training.sequence_parallel  # linears regather their inputs (local_ops.py)
        self.rng = rng
        self.compile = compile  # each program through torch.compile (runtime/tp/program.py ``compiled``)
        self.decisions = {d.name: d for d in plan.nodes}
        # at cp > 1 the rank's own slice of every sequence (runtime/cp/program.py)
        captured = _capture(module, plan, loss_fn, cp=context.size if context is not None else 1)
        self.graph_module = captured.graph_module
        self.param_nodes, self.buffer_nodes = captured.param_nodes, captured.buffer_nodes  # placeholder -> name
        self._check_graph(captured)
        check_layouts(plan, captured)  # every strategy, placement and collective re-derived on this graph
        # The nodes this rank runs (a pipeline stage's; all by default): it holds the
        # parameters and buffers they read, and no others.
        graph = captured.graph_module.graph
        self.nodes = [n for n in graph.nodes if n.op != "placeholder" and (keep is None or keep(n))]
        kept = {n.name for n in self.nodes}
        # A placeholder no node reads is held on its own stage only when no other placeholder of
        # the same tensor is read (a tied parameter's unused duplicate is no copy to hold).
        same = {**captured.param_nodes, **captured.buffer_nodes}
        read = {same.get(n.name, n.name) for n in graph.nodes if n.op == "placeholder" and n.users}
        held = {n.name for n in graph.nodes if n.op == "placeholder" and (
            keep is None or any(u.name in kept for u in n.users)
            or (not n.users and same.get(n.name, n.name) not in read and keep(n)))}
        # the MoE layers whose experts this rank holds a slice of, over its expert group (runtime/experts.py)
        regions = expert_regions(graph, captured.param_nodes) if experts is not None else []
        if experts is not None:
            _check_experts(plan, regions, captured.param_nodes, experts.size)
        self.experts = ExpertLayers(experts, regions) if experts is not None else None
        self.expert_params = expert_params(regions, captured.param_nodes)  # qualified names, split over "ep"
        state = open_weights(weights) if weights is not None else None
        local = load_local(module, captured, plan, state, held=held, tp=self.tp, device=device,
                           experts=(experts, self.expert_params) if experts is not None else None)
        if state is None:
            module.to("meta")  # drop the full tensors: this rank keeps only its slices
        self.shards = nn.ParameterDict(local.shards)
        self.placements = local.placements  # qualified parameter name -> tp placement
        self._param_by_node = local.param_by_node  # placeholder -> key in self.shards
        self._buffers_by_node: dict[str, torch.Tensor] = {}
        for node, (qualified, value) in local.buffers.items():
            self.register_buffer(qualified.replace(".", "__"), value, persistent=False)
            self._buffers_by_node[node] = getattr(self, qualified.replace(".", "__"))
        self._param_access: ParamAccess | None = None  # who holds the parameters between uses (ZeRO-3)
        self.param_reads, self.param_last_reads = self._param_readers()
        # a node list with its rerun regions (recomputed layers or attention cores) grouped
        self.regions = RegionCache(plan, graph.nodes, {*self.param_nodes, *self.buffer_nodes})
        self._programs: dict[tuple[str, bool], Program] = {}  # (name, training) -> the built program
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self._inputs = placeholders  # the whole program's arguments: the placeholders in graph order
        self._user_slots = [i for i, n in enumerate(placeholders) if not self.holds(n)]
        self._held_values = [self.placeholder_value(n, None) if self.holds(n) else None for n in placeholders]
        # the positions and attention cores that see the whole sequence over "cp" (runtime/cp/program.py)
        self.context = None if context is None else ContextParallel(
            context, plan.training.cp_attention, self.graph_module,
            user_inputs={placeholders[i].name for i in self._user_slots}, buffers=self._buffers_by_node,
            module_of={d.name: d.module for d in plan.nodes}, micro_batch=plan.training.micro_batch_size)

    def _param_readers(self) -> tuple[dict[str, list[nn.Parameter]], dict[str, list[nn.Parameter]]]:
        """Per node this rank runs, the parameters it reads (directly, or through a chain of view
        ops such as ``t`` or ``view``, whose outputs alias the parameter's storage), and per node
        those it is the last in graph order to read: after it, forward is done with them."""
        graph_nodes = list(self.graph_module.graph.nodes)
        order = {n.name: i for i, n in enumerate(graph_nodes)}
        placeholders = {n.name: n for n in graph_nodes if n.op == "placeholder"}
        runs = {n.name for n in self.nodes}
        reads: dict[str, list[nn.Parameter]] = {}
        last: dict[str, str] = {}  # shard key -> its last reader (over all of a tied parameter's placeholders)
        for node_name, key in self._param_by_node.items():
            param = self.shards[key]
            frontier = [u for u in placeholders[node_name].users if u.name in runs]
            seen: set[str] = set()
            while frontier:
                u = frontier.pop()
                if u.name in seen:
                    continue
                seen.add(u.name)
                if not any(q is param for q in reads.setdefault(u.name, [])):
                    reads[u.name].append(param)
                if _aliases(u.target):
                    frontier += [v for v in u.users if v.name in runs]
            for name in seen:
                if key not in last or order[name] > order[last[key]]:
                    last[key] = name
        last_reads: dict[str, list[nn.Parameter]] = {}
        for key, node_name in last.items():
            last_reads.setdefault(node_name, []).append(self.shards[key])
        return reads, last_reads

    def _check_graph(self, captured: CapturedModel) -> None:
        names = [n.name for n in captured.graph_module.graph.nodes]
        missing = [n for n in names if n not in self.decisions]
        if missing:
            raise PlanError(
                f"the plan has no tensor-parallel decision for {len(missing)} of the {len(names)} nodes of "
                f"this model's training graph (first: {', '.join(missing[:3])})",
                hint="recompile the plan for this model (and loss) with `partita compile`",
            )

    # -- running -------------------------------------------------------------------------

    def local_parameters(self) -> dict[str, tuple[nn.Parameter, str]]:
        """Qualified name -> (this rank's shard, its tp placement)."""
        return {k.replace("/", "."): (p, self.placements[k.replace("/", ".")]) for k, p in self.shards.items()}

    @property
    def param_access(self) -> ParamAccess | None:
        return self._param_access

    @param_access.setter
    def param_access(self, access: ParamAccess | None) -> None:
        self._param_access = access
        self._programs.clear()  # its gathers and releases are nodes of the programs: build them again

    def program(self, name: str, nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
                outputs: list[torch.fx.Node]) -> Program:
        """The program of ``nodes`` (runtime/tp/program.py) taking the values of ``inputs`` and
        returning those of ``outputs``, built on first use in the module's mode and kept under
        ``name`` (a caller passes the same lists under one name)."""
        key = (name, self.training)
        program = self._programs.get(key)
        if program is None:
            module = build_program(self, self.regions(nodes), inputs, outputs, training=self.training,
                                   compiling=self.compile)
            program = self._programs[key] = Program(module, self.tp, compile=self.compile, name=name)
        return program

    def run(self, name: str, nodes: list[torch.fx.Node], inputs: list[torch.fx.Node],
            outputs: list[torch.fx.Node], values: list[Any]) -> tuple[Any, ...]:
        """Run the program ``name`` (``program``) on ``values``, under the precision policy's autocast."""
        with self.precision.autocast(self.device):
            return self.program(name, nodes, inputs, outputs)(*values)

    def forward(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """One micro-batch through the whole graph: the loss (or, without a loss, the output)."""
        users = (*inputs, targets) if targets is not None else inputs
        values = list(self._held_values)
        if len(users) != len(self._user_slots):
            raise PlanError(f"the model takes {len(self._user_slots)} inputs (targets included), got {len(users)}",
                            hint="pass the planned inputs, and targets=")
        for slot, user in zip(self._user_slots, users):
            values[slot] = self.placeholder_value(self._inputs[slot], user)
        (out,) = self.run("whole", self.nodes, self._inputs, [self.nodes[-1]], values)
        return out[-1] if isinstance(out, (tuple, list)) and targets is not None else out

    def buffers_by_node(self) -> dict[str, torch.Tensor]:
        """The buffers this rank holds, by placeholder name (``buffer_nodes`` names them)."""
        return dict(self._buffers_by_node)

    def holds(self, n: torch.fx.Node) -> bool:
        """Whether placeholder ``n`` is a parameter or buffer this rank holds (not a user input)."""
        return n.name in self._param_by_node or n.name in self._buffers_by_node

    def placeholder_value(self, n: torch.fx.Node, user: torch.Tensor | None) -> torch.Tensor:
        """The local value of placeholder ``n``: this rank's shard or buffer, or the user's
        micro-batch tensor ``user`` (checked against the captured shape)."""
        if n.name in self._buffers_by_node:
            return self._buffers_by_node[n.name]
        if n.name in self._param_by_node:
            return self.shards[self._param_by_node[n.name]]
        want = tuple(n.meta["val"].shape)
        if user is None or tuple(user.shape) != want:
            got = None if user is None else tuple(user.shape)
            raise PlanError(f"input {n.name} has shape {got}, but the plan's micro-batch is {want}",
                            hint="pass batches of the plan's shape, or recompile for this shape")
        return user.to(self.device)


def _check_experts(plan: Plan, regions: list, param_nodes: dict[str, str], ep: int) -> None:
    """A plan that splits experts over ``ep`` ranks, against the MoE layers this model has: some, each
    with a multiple of ``ep`` experts, and the plan's expert layouts on exactly their parameters."""
    if not regions:
        raise PlanError(f"the plan splits experts over ep={ep}, but this model has no MoE layer (grouped matmuls "
                        f"over experts, core/experts.py)",
                        hint="recompile the plan for this model with `partita compile`")
    odd = sorted({r.experts for r in regions if r.experts % ep})
    if odd:
        raise PlanError(f"the plan splits experts over ep={ep}, but this model's MoE layers have {odd} experts, "
                        f"which do not divide over {ep} ranks", hint="recompile with an --ep that divides the experts")
    planned = {p.name for p in plan.params if p.layout.get("ep", "replicate") != "replicate"}
    found = expert_params(regions, param_nodes)
    if planned and planned != found:
        diff = sorted(planned ^ found)
        raise PlanError(f"the plan's expert layouts (ep) are on other parameters than this model's experts "
                        f"(first difference: {diff[0]})",
                        hint="recompile the plan for this model with `partita compile`")


def _micro_batch_specs(plan: Plan, cp: int = 1) -> tuple[list[InputSpec], InputSpec | None]:
    """The plan's input and target specs with the batch dim set to the micro-batch size (and the
    sequence, dim 1, to one cp rank's slice of it)."""
    mbs = plan.training.micro_batch_size

    def micro(text: str) -> InputSpec:
        spec = parse_input_spec(text)
        rest = spec.shape[1:]
        if cp > 1 and rest:
            rest = (rest[0] // cp, *rest[1:])
        return InputSpec(spec.name, spec.dtype, (mbs, *rest))

    if not plan.model.inputs:
        raise PlanError("a tensor-parallel plan must record the model's inputs (plan.model.inputs)",
                        hint="recompile the plan for this model with `partita compile`")
    return [micro(s) for s in plan.model.inputs], micro(plan.model.targets) if plan.model.targets else None


def _capture(module: nn.Module, plan: Plan, loss_fn: Callable | None, cp: int = 1) -> CapturedModel:
    inputs, targets = _micro_batch_specs(plan, cp)
    on_meta = any(t.device.type == "meta" for t in module.parameters())
    # A meta module is captured through fake tensors (export cannot run some models on meta);
    # its tensors are replaced by the local shards anyway.
    model = (lambda: module.to_empty(device="cpu")) if on_meta else module
    return capture(model, inputs, loss=loss_fn, targets=targets, name=plan.model.name)


def apply_tensor_parallel(module: nn.Module, plan: Plan, group: dist.ProcessGroup | None, *,
                          loss_fn: Callable | None, counter: CollectiveCounter, device: torch.device,
                          precision: PrecisionPolicy, rng: tuple[int, int] | None,
                          weights: str | Path | None = None, compile: bool = False,
                          experts: ExpertGroup | None = None, context: ContextGroup | None = None) -> TensorParallel:
    """Compose's tensor-parallel step: this rank's shards of ``module`` and the program over the
    "tp" ``group`` (None: a one-rank group, for a plan that only recomputes or splits experts),
    each MoE layer's experts split over ``experts`` when given."""
    return TensorParallel(module, plan, group, loss_fn=loss_fn, counter=counter, device=device,
                          weights=weights, precision=precision, rng=rng, compile=compile, experts=experts,
                          context=context)
