"""The per-rank program: a plan's node decisions made, once, into generated code over local tensors.

``build_program`` turns nodes of the captured graph (the whole graph, a pipeline stage's, or a
recomputed layer's) into a ``torch.fx.GraphModule`` of this rank's ops only, built before the
first micro-batch and cached (``TensorParallel.program``). Every decision that depends on the
plan and the graph alone is taken while building, none while running:

- each tensor input is resharded from its producer's placement to the one the node's strategy
  needs by one graph node (``reshard``: the plan's ``fwd`` collective in forward, ``bwd`` on the
  gradient, runtime/tp/collectives.py); an edge that needs neither is no node at all;
- size arguments (``view``, ``reshape``, ``expand``, ``unflatten``) are the local sizes;
- ops with a local program (runtime/tp/local_ops.py; a sequence-parallel linear too), random ops
  (seeded per op, runtime/rng.py), the division of a mean over a sharded dim, and ZeRO-3's
  gather / release of a node's parameters (``ParamAccess``) are graph nodes;
- a recomputed layer (runtime/tp/recompute.py) is a sub-program run under checkpointing;
- eval mode is a program of its own (``_TRAIN_ARG``'s ops in eval; no buffer update).

The first run of each program goes node by node (``torch.fx.Interpreter``) and checks every
local output's shape against the plan, naming the node on a mismatch or a failure; later runs
call the generated code. The program is what ``compile=True`` hands to ``torch.compile``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.fx
import torch.utils.checkpoint
from torch import nn

from partita.core.errors import PlanError
from partita.core.model.ops import tensor_values
from partita.core.placement import shard_dim
from partita.core.plans.plan import NodeDecision
from partita.core.precision import PrecisionPolicy
from partita.core.tp.layout import regathers
from partita.runtime.experts import ExpertLayers, carry, combine, dispatch
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.rng import is_random, op_seed, seeded
from partita.runtime.tp.collectives import Edge, TPGroup, local_shape, reshard_edge
from partita.runtime.tp.local_ops import LOCAL_OPS, RegatheredLinear
from partita.runtime.tp.recast import NORMS, Recast, as_dtype_of
from partita.runtime.tp.recompute import Region, run_recomputed

_SIZE_ARG = frozenset({"view", "reshape", "_unsafe_view", "expand"})
# The captured graph is the training forward. In eval mode (``module.eval()``) the ops whose result
# depends on the mode run as PyTorch runs them in eval: their ``train`` argument (at this index)
# False, so dropout passes its input through and batch norm normalises by its running statistics.
_TRAIN_ARG = {"dropout": 2, "feature_dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2, "batch_norm": 5}
_CHECK = "partita_check"  # node.meta key: (original node, decision) of a node whose local shapes are checked
class ParamAccess(Protocol):
    """Who holds the parameters between their uses (ZeRO-3, runtime/dp/zero.py): the program
    asks for a node's parameters before it runs and says when forward is done with them."""

    def gather_params(self, params: Sequence[nn.Parameter]) -> None: ...

    def used_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...

    def release_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...


class LocalProgram(Protocol):
    """What the builder reads of the rank's tensor-parallel part (runtime/tp/module.py)."""

    graph_module: torch.fx.GraphModule
    decisions: Mapping[str, NodeDecision]
    tp: TPGroup
    device: torch.device
    precision: PrecisionPolicy
    rng: tuple[int, int] | None  # (run seed, dp rank), or None: random ops draw from the user's generator
    param_access: ParamAccess | None
    sequence_parallel: bool  # the plan's: linears regather their sequence-split inputs (core/tp/layout.py)
    param_reads: Mapping[str, list[nn.Parameter]]  # node -> the parameters it reads
    param_last_reads: Mapping[str, list[nn.Parameter]]  # node -> those forward is done with after it
    buffer_nodes: Mapping[str, str]  # buffer placeholder -> its name
    experts: ExpertLayers | None  # the MoE layers whose experts are split over "ep" (runtime/experts.py)
    context: Any  # the nodes that see the whole sequence over "cp" (runtime/cp/program.py), or None


def op_name(n: torch.fx.Node) -> str:
    """The op a node calls, as ``LOCAL_OPS`` keys it ("linear", "getitem", ...)."""
    if n.target is operator.getitem:
        return "getitem"
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def expected_shapes(g: TPGroup, n: torch.fx.Node, d: NodeDecision) -> list[tuple[int, ...]]:
    """The local shapes of ``n``'s tensor outputs on this rank: the global ones, sharded as the plan says."""
    return [local_shape(v.shape, p, g.size) for v, p in zip(tensor_values(n.meta.get("val")), d.out)]


# -- what the generated code calls -----------------------------------------------------------------


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: how generated code calls an object the program holds (a local op,
    a seeded random op, a recomputed layer)."""
    return fn(*args, **kwargs)


def gather(access: ParamAccess, params: list[nn.Parameter]) -> None:
    access.gather_params(params)


def used(access: ParamAccess, params: list[nn.Parameter], out: Any, done: list[nn.Parameter] | None) -> None:
    access.used_params(params, out)
    if done:
        access.release_params(done, out)


class AsCaptured:
    """A higher-order op (a wrapped subgraph) run with autocast off, as it was captured."""

    def __init__(self, op: Any, device: torch.device) -> None:
        self.op, self.device = op, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device.type, enabled=False):
            return self.op(*args, **kwargs)


def view_or_reshape(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``x.view(shape)``, or a copy when a resharded local tensor's strides do not allow the view
    the captured program took (a ``.contiguous()`` that was a no-op there is not in the graph)."""
    try:
        return x.view(shape)
    except RuntimeError:
        return x.reshape(shape)


class LocalOp:
    """A node whose (op, strategy) has a local program (runtime/tp/local_ops.py), bound to its node."""

    def __init__(self, fn: Callable[..., Any], g: TPGroup, n: torch.fx.Node) -> None:
        self.fn, self.g, self.n = fn, g, n

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.g, self.n, list(args), kwargs)


class RandomOp:
    """A random op drawn with the generator seeded for it alone (runtime/rng.py ``op_seed``)."""

    def __init__(self, target: Any, name: str, rng: tuple[int, int], tp_rank: int | None,
                 device: torch.device) -> None:
        self.target, self.name, self.tp_rank, self.device = target, name, tp_rank, device
        self.base, self.dp_rank = rng

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        seed = op_seed(self.base, self.name, FLIGHT.step, FLIGHT.micro_batch, self.dp_rank, self.tp_rank)
        with seeded(seed, self.device):
            return self.target(*args, **kwargs)


class Recomputed(nn.Module):
    """A recomputed layer: its sub-program, whose intermediates are rebuilt in backward under the
    autocast the forward ran in. In a program for ``torch.compile``, torch's own checkpoint, which
    the compiler traces (as its activation-checkpoint region) where it cannot trace ours."""

    def __init__(self, program: torch.fx.GraphModule, autocast: Callable[[], Any], compiling: bool) -> None:
        super().__init__()
        self.program, self.autocast, self.compiling = program, autocast, compiling

    def forward(self, *values: Any) -> tuple[Any, ...]:
        if self.compiling and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.program, *values, use_reentrant=False)
        return run_recomputed(self.program.forward, values, self.autocast)  # its generated code: no module call


# -- building ----------------------------------------------------------------------------------------


def build_program(p: LocalProgram, items: Sequence[torch.fx.Node | Region], inputs: Sequence[torch.fx.Node],
                  outputs: Sequence[torch.fx.Node], *, training: bool, compiling: bool = False) -> torch.fx.GraphModule:
    """The generated program of ``items`` (nodes of ``p.graph_module`` in order, recomputed layers
    grouped): its arguments are the values of ``inputs``, it returns those of ``outputs``;
    ``compiling``: for ``torch.compile`` (``Recomputed``)."""
    return _Builder(p, training, compiling).build(items, inputs, outputs)


class _Builder:
    def __init__(self, p: LocalProgram, training: bool, compiling: bool = False) -> None:
        self.p, self.training, self.compiling = p, training, compiling
        self.graph = torch.fx.Graph()
        self.attrs: dict[str, Any] = {}
        self.env: dict[torch.fx.Node, Any] = {}
        # the captured dtype's constants in the compute dtype's (low precision)
        self.recast = Recast.of(p.graph_module, p.precision)
        self.order: dict[torch.fx.Node, int] | None = None  # the captured graph's order, when asked
        # MoE layer -> (its route, local offsets, the rows it dispatched (graph node), those rows here)
        self.routes: dict[str, tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, torch.fx.Node]] = {}

    def attr(self, prefix: str, obj: Any) -> torch.fx.Node:
        """A get_attr node for ``obj``, which the program holds as an attribute."""
        name = f"{prefix}_{len(self.attrs)}"
        self.attrs[name] = obj
        return self.graph.get_attr(name)

    def build(self, items: Sequence[torch.fx.Node | Region], inputs: Sequence[torch.fx.Node],
              outputs: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
        for n in inputs:
            self.env[n] = self.graph.placeholder(n.name)
        for item in items:
            if isinstance(item, Region):
                self._region(item)
            else:
                self.env[item] = self._node(item)
        self.graph.output(tuple(self.env[n] for n in outputs))
        module = torch.fx.GraphModule(self.attrs, self.graph, class_name="RankProgram")
        return module

    def _region(self, r: Region) -> None:
        sub = _Builder(self.p, self.training, self.compiling).build(r.nodes, r.inputs, r.outputs)
        autocast = functools.partial(self.p.precision.autocast, self.p.device)
        out = self.graph.call_function(call, (self.attr("recomputed", Recomputed(sub, autocast, self.compiling)),
                                              *(self.env[a] for a in r.inputs)))
        for i, o in enumerate(r.outputs):
            self.env[o] = self.graph.call_function(operator.getitem, (out, i))

    def _node(self, n: torch.fx.Node) -> Any:
        if n.op == "get_attr":
            return self.attr("constant", _fetch_attr(self.p.graph_module, n.target))
        if self.p.context is not None and n.name in self.p.context.skipped:
            return None  # inside a written-out attention core, which its closing matmul runs over "cp"
        d = self.p.decisions[n.name]
        reads = self.p.param_reads.get(n.name) if self.p.param_access is not None else None
        if reads:  # before the inputs are resharded: they read the parameters
            self.graph.call_function(gather, (self.attr("access", self.p.param_access), self.attr("params", reads)))
        regather = self._regathers(n, d)
        args, kwargs = self._local_args(n, d, raw=regather)
        if n.op == "output":
            return args[0]
        if n.op != "call_function":
            raise PlanError(f"node {n.name}: {n.op} nodes are not supported by the tensor-parallel runtime",
                            hint="plan this model without tensor parallelism (--tp 1)")
        if n.target is torch.ops.aten._assert_tensor_metadata.default and self.p.precision.low:
            return None  # export's check of the captured (fp32) dtype: the policy computes in another
        experts = self.p.experts
        if self.p.context is not None and self.p.context.replaces(n.name):
            out = self.p.context.emit(self, n, args, kwargs)
        elif regather:  # the gathered input kept by the op itself, as its slice (runtime/tp/local_ops.py)
            out = self.graph.call_function(call, (self.attr("regathered", RegatheredLinear(Edge(self.p.tp, d.ins[0]))),
                                                  *args), kwargs)
        elif experts is not None and n.name in experts.region_of:
            out = self._expert_matmul(n, d, args, kwargs, experts)
        elif experts is not None and n.name in experts.chain_of and op_name(n) in _SIZE_ARG:
            # a view of a stacked weight per expert (DBRX's (E x F, H) as (E, F, H)): this rank holds E / ep
            out = self.graph.call_function(view_or_reshape, (args[0], [-1, *n.meta["val"].shape[1:]]))
        elif experts is not None and n.name in experts.carried:
            region, values = experts.carried[n.name]
            route = self.routes[region.offsets][0]
            args = [self.graph.call_function(carry, (a, route)) if isinstance(x, torch.fx.Node) and x.name in values
                    else a for a, x in zip(args, n.args)]
            out = self._op(n, d, args, kwargs)
        else:
            out = self._op(n, d, args, kwargs)
        if isinstance(out, torch.fx.Node) and not (experts is not None and n.name in experts.local):
            out.meta[_CHECK] = (n, d)  # (an MoE layer's rows and experts under "ep" are this rank's own)
        if reads:
            done = self.p.param_last_reads.get(n.name)
            self.graph.call_function(used, (self.attr("access", self.p.param_access), self.attr("params", reads),
                                            out, self.attr("params", done) if done else None))
        return out

    def _expert_matmul(self, n: torch.fx.Node, d: NodeDecision, args: list, kwargs: dict,
                       experts: ExpertLayers) -> torch.fx.Node:
        """A grouped matmul of an MoE layer whose experts are split over "ep" (runtime/experts.py):
        the layer's first reads the rows dispatched to this rank's experts, each reads their local
        offsets, and the last one's rows are combined back to their tokens' ranks."""
        region = experts.region_of[n.name]
        offs_at = 2 if len(args) > 2 else None
        if n.name == region.first:
            offs = args[2] if offs_at is not None else kwargs["offs"]
            sent = self.graph.call_function(dispatch, (self.attr("experts", experts.g), args[0], offs))
            args[0] = self.graph.call_function(operator.getitem, (sent, 0))
            self.routes[region.offsets] = (self.graph.call_function(operator.getitem, (sent, 2)),
                                           self.graph.call_function(operator.getitem, (sent, 1)), n.args[0], args[0])
        elif n.args[0] is self.routes[region.offsets][2]:  # the layer's rows again (DBRX's up beside its gate)
            args[0] = self.routes[region.offsets][3]
        route, local_offs = self.routes[region.offsets][:2]
        if offs_at is not None:
            args[offs_at] = local_offs
        else:
            kwargs = {**kwargs, "offs": local_offs}
        out = self._op(n, d, args, kwargs)
        if n.name == region.last:
            out = self.graph.call_function(combine, (out, route))
        return out

    def _regathers(self, n: torch.fx.Node, d: NodeDecision) -> bool:
        """Whether ``n`` gathers its first input itself, again in backward (core/tp/layout.py)."""
        return (self.training and n.op == "call_function" and bool(d.ins) and LOCAL_OPS.get((op_name(n), d.strategy))
                is None and regathers(op_name(n), 0, d.ins[0].fwd, self.p.sequence_parallel, [x.grad for x in d.ins]))

    def _local_args(self, n: torch.fx.Node, d: NodeDecision, raw: bool = False) -> tuple[list, dict]:
        """``n``'s tensor arguments resharded by their plan edges (``raw``: the first left as placed)."""
        j = 0
        getitem = n.target is operator.getitem

        def fetch(a: torch.fx.Node) -> Any:
            nonlocal j
            v = self.env[a]
            if not tensor_values(a.meta.get("val")):
                return v
            lay = d.ins[j]
            j += 1
            return v if getitem or (raw and j == 1) else self._edge(v, lay)

        args = list(torch.fx.map_arg(n.args, fetch))
        kwargs = dict(torch.fx.map_arg(n.kwargs, fetch))
        if j != len(d.ins):
            raise PlanError(f"node {n.name}: the plan lists {len(d.ins)} tensor inputs, the graph has {j}",
                            hint="recompile the plan for this model with `partita compile`")
        if getitem:  # of a tuple of tensors: the edge applies to the item; of anything else (a shape), none
            item = self.graph.call_function(operator.getitem, (args[0], args[1]))
            args = [self._edge(item, d.ins[0]) if d.ins else item]
        return args, kwargs

    def _edge(self, v: Any, lay: Any) -> Any:
        if lay.fwd == "none" and lay.bwd == "none":
            return v
        return self.graph.call_function(reshard_edge, (v, self.attr("edge", Edge(self.p.tp, lay))))

    def _op(self, n: torch.fx.Node, d: NodeDecision, args: list, kwargs: dict) -> Any:
        g, name = self.p.tp, op_name(n)
        if name == "getitem":
            return args[0]
        local = LOCAL_OPS.get((name, d.strategy))
        if local is not None:
            return self.graph.call_function(call, (self.attr("local", LocalOp(local, g, n)), *args), kwargs)
        if self.recast is not None:
            args, kwargs = self.recast.args(n, name, args, kwargs)
            if name in NORMS and len(args) > NORMS[name] and isinstance(args[NORMS[name]], torch.fx.Node):
                args[0] = self.graph.call_function(as_dtype_of, (args[0], args[NORMS[name]]))
            if isinstance(n.target, torch._ops.HigherOrderOperator):
                # a region export wrapped (torch 2.11's ``wrap_with_set_grad_enabled``: a rotary
                # embedding under no_grad) runs its captured subgraph, which is not recast and checks
                # its dtypes: it runs as captured, its tensors in their captured dtypes, without autocast
                # (the eager model computes such regions in fp32 with autocast off)
                args = [self.graph.call_function(torch.Tensor.to, (a, o.meta["val"].dtype))
                        if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)
                        and o.meta["val"].is_floating_point() else a for a, o in zip(args, n.args)]
                return self.graph.call_function(call, (self.attr("as_captured", AsCaptured(n.target, self.p.device)),
                                                       *args), kwargs)
        if not self.training:
            if name in _TRAIN_ARG and len(args) > _TRAIN_ARG[name]:
                args[_TRAIN_ARG[name]] = False
            elif name.endswith("_") and isinstance(n.args[0], torch.fx.Node) and n.args[0].name in self.p.buffer_nodes:
                return args[0]  # a buffer's in-place update (batch norm's count of batches): training only
        val = n.meta.get("val")
        if name in _SIZE_ARG:
            args[1] = list(local_shape(val.shape, d.out[0], g.size))
        elif name == "unflatten":
            dim = args[1] % val.dim()
            args[2] = list(local_shape(val.shape, d.out[0], g.size))[dim:dim + len(args[2])]
        if name in ("dropout", "feature_dropout", "alpha_dropout") and args[1] == 0:
            return args[0]  # p = 0 draws nothing and changes nothing
        if self.p.rng is not None and is_random(n.target, args, kwargs):
            sharded = shard_dim(d.out[0]) is not None if d.out else False
            op = RandomOp(n.target, n.name, self.p.rng, g.rank if sharded else None, self.p.device)
            return self.graph.call_function(call, (self.attr("random", op), *args), kwargs)
        target = n.target
        if name.endswith("_") and args and self._resharded(args[0]) and not self._read_after(n.args[0], n):
            # an in-place op on a reshard's output (Falcon's ``add_``, DeBERTa's ``+=``): the reshard
            # made this input for this op alone and nothing reads the original after it, so the
            # op's out-of-place form computes the same (autograd refuses in-place on a Function's view)
            target = _out_of_place(n.target) or target
        if name == "view":
            out = self.graph.call_function(view_or_reshape, (args[0], args[1]))
        else:
            out = self.graph.call_function(target, tuple(args), kwargs)
        if name == "mean" and d.out[0] == "partial" and shard_dim(d.ins[0].need) is not None:
            out.meta[_CHECK] = None
            out = self.graph.call_function(operator.truediv, (out, g.size))  # as by the global count
        return out

    @staticmethod
    def _resharded(v: Any) -> bool:
        return isinstance(v, torch.fx.Node) and v.target is reshard_edge

    def _read_after(self, value: Any, n: torch.fx.Node) -> bool:
        """Whether a node after ``n`` in the captured graph reads ``value`` (a node)."""
        if not isinstance(value, torch.fx.Node):
            return False
        if self.order is None:
            self.order = {m: i for i, m in enumerate(self.p.graph_module.graph.nodes)}
        return any(self.order[u] > self.order[n] for u in value.users if u is not n)


def _out_of_place(op: Any) -> Any:
    """``aten.add_.Tensor`` -> ``aten.add.Tensor``; None when there is none."""
    packet = getattr(op, "overloadpacket", None)
    base = getattr(torch.ops.aten, packet.__name__.rstrip("_"), None) if packet is not None else None
    return getattr(base, op._overloadname, None) if base is not None else None


def _fetch_attr(module: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# -- running ---------------------------------------------------------------------------------------


class CheckedRun(torch.fx.Interpreter):
    """A program's first run, node by node: every local output's shape is checked against the plan,
    and a failure names the graph node it came from."""

    def __init__(self, module: torch.fx.GraphModule, g: TPGroup) -> None:
        super().__init__(module)
        self.g = g

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op == "call_function" and node.target is call and isinstance(self.env.get(node.args[0]), Recomputed):
            region = self.env[node.args[0]]
            args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
            return run_recomputed(lambda *v: CheckedRun(region.program, self.g).run(*v), args, region.autocast)
        check = node.meta.get(_CHECK)
        try:
            out = super().run_node(node)
        except PlanError:
            raise
        except Exception as e:
            if check is None:
                raise
            n, d = check
            raise RuntimeError(f"tensor-parallel node {n.format_node()} (strategy {d.strategy!r}, "
                               f"module {d.module or '<root>'}) failed on tp rank {self.g.rank}: {e}") from e
        if check is not None:
            n, d = check
            got = [tuple(v.shape) for v in tensor_values(out)]
            want = expected_shapes(self.g, n, d)
            if got != want:
                raise PlanError(
                    f"tensor-parallel node {n.format_node()} (strategy {d.strategy!r}, outputs {list(d.out)}) "
                    f"produced local shapes {got} on tp rank {self.g.rank}, the plan expects {want}",
                    hint="recompile the plan for this model with `partita compile`")
        return out


class Program:
    """A built program and how it runs: checked node by node the first time, then its generated
    code, or (``compile``) that code through ``torch.compile`` (``compiled``)."""

    def __init__(self, module: torch.fx.GraphModule, g: TPGroup, *, compile: bool = False,
                 name: str = "program") -> None:
        self.module, self.g = module, g
        self.compile, self.name = compile, name
        self.runner: Callable[..., Any] | None = None

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        if self.runner is not None:
            return self.runner(*values)
        out = CheckedRun(self.module, self.g).run(*values)
        self.runner = compiled(self.module, f"the rank's {self.name} program") if self.compile else self.module
        return out


def compiled(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``fn`` through ``torch.compile`` (inductor): whole (``fullgraph``) where it can be; where
    it cannot, one line says where the graph breaks and it runs compiled in pieces."""
    whole = torch.compile(fn, fullgraph=True)
    chosen: list[Callable[..., Any]] = []

    def run(*values: Any) -> Any:
        if chosen:
            return chosen[0](*values)
        try:
            out = whole(*values)
            chosen.append(whole)
            return out
        except torch._dynamo.exc.TorchDynamoException as e:  # raised while tracing, before anything ran
            reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            if _reports():
                print(f"partita: torch.compile: {what} breaks the graph ({reason[:160]}); it runs compiled "
                      "in pieces", flush=True)
            chosen.append(torch.compile(fn))
            return chosen[0](*values)

    return run


def _reports() -> bool:
    """Whether this rank prints what every rank would (rank 0, or the only process)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
