"""Tensor parallelism: run a plan's node decisions on this rank with local tensors.

``TensorParallel`` captures the training graph (model + loss) itself, keeps only
this rank's shard of every parameter (``NodeDecision.out`` of its placeholder,
``ParamDecision.layout["tp"]``), and runs the graph with an fx Interpreter over
LOCAL tensors. Each tensor input of a node is brought from the producer's
placement (``InputLayout.have``) to the one the node's strategy needs through
one autograd Function that runs the plan's ``fwd`` collective in forward and its
``bwd`` collective in backward; the op then runs on the local pieces (with a
few local implementations keyed by (op, strategy): vocabulary-parallel
embedding, softmax and cross-entropy, row-parallel biases added on tp rank 0,
means over a sharded dim divided by the global count).

Local tensors rather than DTensor: explicit control means the collectives run
are exactly the plan's, one per recorded reshard (and each op-internal one),
so ``passes/tp_layout.tp_collectives`` predicts them call for call and the
``CollectiveCounter`` checks it. Every local output's shape is checked against
the plan; a mismatch raises naming the node.

Activation recomputation (``Stage.recompute``). On a stage that recomputes,
each maximal run of consecutive nodes (program order) of one repeated layer
(``NodeDecision.layer``, e.g. "transformer.h.3") is a region, run under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: forward keeps only
the region's inputs (the values it reads from outside, parameters included)
and its outputs (the values read outside it: by later nodes, the output node
or, in a pipeline, another stage, which the stage sends), and backward reruns
the region's forward to rebuild what its backward needs. Nodes outside the
layers (embeddings, final norm, head, loss) run as usual. The rerun is the
region's whole forward (``early_stop=False``), so its reshards and op-internal
collectives run once more per micro-batch, exactly the forward-side ones of the
recomputed nodes, as the plan lists them and as Megatron does; the RNG state is
restored for the rerun, so dropout draws the same mask. Only while gradients
are enabled: an inference forward runs the nodes plainly. Not with ZeRO-3
(engine.refuse_unsupported): the rerun would gather and release parameters
under views the recomputed forward has just saved.

Placements (see passes/tp_strategies.py): "replicate", "shard(D)" (rank r holds
the r-th of t equal slices of dim D), "partial" (the ranks' tensors sum to the
value). Collective byte counts are the whole tensor's (the gathered / reduced
tensor), as in the plan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.utils.checkpoint
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from partita.core.capture import CapturedModel, capture
from partita.core.errors import PlanError
from partita.core.inputs import InputSpec, parse_input_spec
from partita.core.placement import shard_dim as _shard_dim
from partita.core.plan import InputLayout, MeshAxis, NodeDecision, Plan
from partita.core.precision import FP32
from partita.passes.verify import check_layouts
from partita.runtime.data_parallel import CollectiveCounter
from partita.runtime.rng import is_random, op_seed, seeded
from partita.runtime.sharded_state import open_weights
from partita.runtime.watchdog import FLIGHT

TP = MeshAxis.TP.value


def _tensors(val: Any) -> list[Any]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in _tensors(v)]
    return []


def _weight(state: Any, qualified: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
    """``qualified``'s tensor in a weights file, under any of its tied names (safetensors keeps one)."""
    names = [qualified] + [n for n, p in params.items() if p is params[qualified] and n != qualified]
    for name in names:
        if name in state:
            return state[name]
    raise PlanError(f"the weights file has no {' or '.join(names)}",
                    hint="pass the state dict of this model (its names as in model.state_dict())")


class TPGroup:
    """The TP process group of this rank, with every collective counted (axis "tp")."""

    def __init__(self, group: dist.ProcessGroup | None, counter: CollectiveCounter) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.size = dist.get_world_size(group) if group is not None else 1
        self.counter = counter

    def _record(self, kind: str, t: torch.Tensor) -> None:
        self.counter.record(kind, TP, t.numel() * t.element_size())

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or ``op``) over the group into a new tensor; ``x`` is left alone."""
        out = x.contiguous().clone()
        self._record("all_reduce", out)
        with self.counter.blocking("all_reduce", TP):
            dist.all_reduce(out, op=op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((local.shape[0] * self.size, *local.shape[1:]))
        self._record("all_gather", out)
        with self.counter.blocking("all_gather", TP):
            dist.all_gather_into_tensor(out, local, group=self.group)
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        whole = x.movedim(dim, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // self.size, *whole.shape[1:]))
        self._record("reduce_scatter", whole)
        with self.counter.blocking("reduce_scatter", TP):
            dist.reduce_scatter_tensor(out, whole, group=self.group)
        return out.movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, src: int, dst: int) -> torch.Tensor:
        """shard(src) -> shard(dst): send the k-th dst-slice to rank k, join the pieces along src."""
        send = torch.stack(x.chunk(self.size, dim=dst)).contiguous()  # (t, ...local with dst/t)
        recv = torch.empty_like(send)
        self.counter.record("all_to_all", TP, send.numel() * send.element_size() * self.size)
        with self.counter.blocking("all_to_all", TP):
            dist.all_to_all_single(recv, send, group=self.group)
        return torch.cat(recv.unbind(0), dim=src)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of dim ``dim`` (no traffic)."""
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()


def reshard(g: TPGroup, x: torch.Tensor, kind: str, src: str, dst: str) -> torch.Tensor:
    """Turn ``x`` (placement ``src``) into placement ``dst`` with the collective ``kind``."""
    if kind == "none":
        return x
    s, d = _shard_dim(src), _shard_dim(dst)
    if kind == "slice":
        return g.take(x, d)
    if kind == "all_gather":
        return g.all_gather(x, s)
    if kind == "all_reduce":
        return g.all_reduce(x)
    if kind == "reduce_scatter":
        return g.reduce_scatter(x, d)
    if kind == "all_to_all":
        return g.all_to_all(x, s, d)
    raise ValueError(f"unknown reshard {kind!r} ({src} -> {dst})")


class _Reshard(torch.autograd.Function):
    """One edge of the plan: ``fwd`` in forward, ``bwd`` on the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: TPGroup, lay: InputLayout) -> torch.Tensor:
        ctx.g, ctx.lay = g, lay
        out = reshard(g, x, lay.fwd, lay.have, lay.need)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        lay = ctx.lay
        return reshard(ctx.g, grad, lay.bwd, lay.grad, lay.grad_need), None, None


def _edge(g: TPGroup, x: Any, lay: InputLayout) -> Any:
    if not isinstance(x, torch.Tensor) or (lay.fwd == "none" and lay.bwd == "none"):
        return x
    return _Reshard.apply(x, g, lay)


# -- local implementations keyed by (op, strategy) ----------------------------------

class _VocabCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits sharded on the class dim: 3 all-reduces, none in backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, g: TPGroup, ignore_index: int) -> torch.Tensor:
        ctx.dtype = logits.dtype
        logits = logits.float()  # the softmax in fp32 whatever the compute dtype (as autocast runs a loss)
        n, c = logits.shape  # (N, C/t)
        lo = g.rank * c
        m = g.all_reduce(logits.detach().amax(dim=1), dist.ReduceOp.MAX)  # (N,)
        z = logits - m[:, None]
        e = z.exp()
        s = g.all_reduce(e.sum(dim=1))  # (N,)
        valid = targets != ignore_index
        local_t = targets - lo
        mine = valid & (local_t >= 0) & (local_t < c)
        picked = z.gather(1, local_t.clamp(0, c - 1)[:, None]).squeeze(1) * mine
        target_logit = g.all_reduce(picked)  # (N,)
        count = valid.sum()
        loss = ((s.log() - target_logit) * valid).sum() / count
        ctx.save_for_backward(e / s[:, None], local_t, mine, valid, count)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_t, mine, valid, count = ctx.saved_tensors
        out = softmax.clone()
        rows = mine.nonzero().squeeze(1)
        out[rows, local_t[rows]] -= 1
        out *= (valid[:, None] * grad / count).to(out.dtype)
        return out.to(ctx.dtype), None, None, None


class _VocabSoftmax(torch.autograd.Function):
    """(log-)softmax over a sharded dim: all-reduced max and sum in forward, one all-reduce back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, log: bool, g: TPGroup) -> torch.Tensor:
        ctx.dtype = x.dtype
        x = x.float()  # in fp32 whatever the compute dtype, as autocast runs softmax
        m = g.all_reduce(x.detach().amax(dim=dim, keepdim=True), dist.ReduceOp.MAX)
        z = x - m
        s = g.all_reduce(z.exp().sum(dim=dim, keepdim=True))
        y = z - s.log() if log else z.exp() / s
        ctx.save_for_backward(y)
        ctx.dim, ctx.log, ctx.g = dim, log, g
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (y,) = ctx.saved_tensors
        grad = grad.float()
        if ctx.log:
            total = ctx.g.all_reduce(grad.sum(dim=ctx.dim, keepdim=True))
            return (grad - y.exp() * total).to(ctx.dtype), None, None, None
        total = ctx.g.all_reduce((grad * y).sum(dim=ctx.dim, keepdim=True))
        return (y * (grad - total)).to(ctx.dtype), None, None, None


def _rank0(g: TPGroup, b: torch.Tensor) -> torch.Tensor:
    """The bias on tp rank 0, zeros elsewhere (a partial sum adds it once); gradients flow on all."""
    return b * (1.0 if g.rank == 0 else 0.0)


def _embedding_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    w, idx = args[0], args[1]  # w (V/t, C), idx replicate
    rows = w.shape[0]
    lo = g.rank * rows
    mine = (idx >= lo) & (idx < lo + rows)
    local = torch.where(mine, idx - lo, torch.zeros_like(idx))
    pad = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    pad = pad - lo if pad is not None and 0 <= pad - lo < rows else -1
    out = torch.ops.aten.embedding.default(w, local, pad, *args[3:])
    return out * mine.unsqueeze(-1).to(out.dtype)


def _row_bias(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    name = n.target.__name__.split(".")[0]
    if name == "addmm":
        b, x, w = args[:3]
        return torch.ops.aten.addmm.default(_rank0(g, b), x, w, **kwargs)
    if len(args) < 3 or args[2] is None:
        return n.target(*args, **kwargs)
    if name == "linear":
        return torch.ops.aten.linear.default(args[0], args[1]) + _rank0(g, args[2])
    rest = list(args)
    rest[2] = None  # conv2d: the bias per output channel, on rank 0
    return n.target(*rest, **kwargs) + _rank0(g, args[2]).view(1, -1, 1, 1)


def _softmax_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    name = n.target.__name__.split(".")[0]
    x, dim = args[0], args[1] % args[0].dim()
    return _VocabSoftmax.apply(x, dim, "log" in name, g)


def _ce_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    return _VocabCrossEntropy.apply(args[0], args[1], g, ignore)


def _ce_batch(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    """This rank's rows: the sum of their losses over the global count (a partial mean)."""
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    logits, targets = args[0], args[1]
    count = g.all_reduce((targets != ignore).sum())
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore, reduction="sum") / count


_Local = Callable[[TPGroup, torch.fx.Node, list, dict], Any]
_LOCAL_OPS: dict[tuple[str, str], _Local] = {
    ("embedding", "vocab"): _embedding_vocab,
    ("linear", "row"): _row_bias,
    ("addmm", "row"): _row_bias,
    ("conv2d", "row"): _row_bias,
    ("_softmax", "vocab"): _softmax_vocab,
    ("softmax", "vocab"): _softmax_vocab,
    ("_log_softmax", "vocab"): _softmax_vocab,
    ("log_softmax", "vocab"): _softmax_vocab,
    ("cross_entropy_loss", "vocab"): _ce_vocab,
    ("cross_entropy_loss", "shard(0)"): _ce_batch,
}
_SIZE_ARG = frozenset({"view", "reshape", "_unsafe_view", "expand"})


def _packet(n: torch.fx.Node) -> str:
    if n.target is operator.getitem:
        return "getitem"
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def local_shape(shape: torch.Size | tuple[int, ...], placement: str, t: int) -> tuple[int, ...]:
    out = list(shape)
    d = _shard_dim(placement)
    if d is not None:
        out[d] //= t
    return tuple(out)


# -- the local program -------------------------------------------------------------

class ParamAccess(Protocol):
    """Who holds the parameters between their uses (ZeRO-3, runtime/zero.py): the interpreter
    asks for a node's parameters before it runs and says when forward is done with them."""

    def gather_params(self, params: Sequence[nn.Parameter]) -> None: ...

    def used_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...

    def release_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...


def _aliases(op: Any) -> bool:
    """Whether an aten op's output may be a view of its input (t, view, permute, slice...)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def recomputed_layers(plan: Plan) -> dict[str, str]:
    """Node name -> its repeated layer, for the layer nodes of the stages that recompute."""
    stages = {s.index for s in plan.stages if s.recompute}
    return {d.name: d.layer for d in plan.nodes if d.layer and d.stage in stages}


@dataclass(frozen=True)
class Region:
    """Consecutive nodes of one recomputed layer, what they read from outside, what is read of them."""

    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]  # values produced outside the region that its nodes read
    outputs: tuple[torch.fx.Node, ...]  # its nodes with a user outside it (anywhere in the graph)


def _region(run: list[torch.fx.Node]) -> Region:
    inside = set(run)
    inputs = dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    return Region(tuple(run), tuple(inputs), tuple(outputs))


def recompute_regions(nodes: Sequence[torch.fx.Node], layer_of: Mapping[str, str]
                      ) -> list[torch.fx.Node | Region]:
    """``nodes`` in order, each maximal run of consecutive call nodes of one layer in
    ``layer_of`` (``recomputed_layers``) grouped into a ``Region``."""
    out: list[torch.fx.Node | Region] = []
    run: list[torch.fx.Node] = []
    for n in nodes:
        layer = layer_of.get(n.name, "") if n.op == "call_function" else ""
        if run and layer != layer_of[run[-1].name]:
            out.append(_region(run))
            run = []
        if layer:
            run.append(n)
        else:
            out.append(n)
    if run:
        out.append(_region(run))
    return out


class _LocalInterpreter(torch.fx.Interpreter):
    """Runs graph nodes on local tensors as their decisions say; ``run_nodes`` runs a subset
    (one pipeline stage) over an environment the caller seeds with the values it needs."""

    def __init__(self, program: "TensorParallel") -> None:
        super().__init__(program.graph_module, garbage_collect_values=True)
        self.p = program

    def run_nodes(self, nodes: list[torch.fx.Node], env: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, Any]:
        """Run ``nodes`` (no placeholders) in order; ``env`` holds every value they read from
        elsewhere and receives their outputs."""
        self.env = env
        for item in self.p.regions(nodes):
            if isinstance(item, Region):
                self._run_region(item, env)
            else:
                env[item] = self.run_node(item)
        return env

    def _run_region(self, r: Region, env: dict[torch.fx.Node, Any]) -> None:
        """Run a recomputed layer's nodes under a non-reentrant checkpoint: their values live in
        a local environment, and only the outputs reach ``env``."""
        def forward(*values: Any) -> tuple[Any, ...]:  # also the rerun in backward
            outer = self.env
            self.env = local = dict(zip(r.inputs, values))
            try:
                for n in r.nodes:
                    local[n] = self.run_node(n)
            finally:
                self.env = outer
            return tuple(local[n] for n in r.outputs)

        values = [env[a] for a in r.inputs]
        if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to recompute
            outs = forward(*values)
        else:
            # The whole forward again, no early stop: stopping once the saved tensors are rebuilt
            # would skip a layer's trailing reshards (its row-parallel all-reduce), which the plan
            # lists twice; and the stop is an exception that run_node would report as a failure.
            outs = torch.utils.checkpoint.checkpoint(forward, *values, use_reentrant=False, early_stop=False)
        env.update(zip(r.outputs, outs))

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr"):
            return super().run_node(n)
        d = self.p.decisions[n.name]
        access, reads = self.p.param_access, self.p.param_reads.get(n.name)
        if access is not None and reads:
            access.gather_params(reads)  # before the inputs are resharded: they read the parameters
        args, kwargs = self._local_args(n, d)
        if n.op == "output":
            return args[0]
        if n.op != "call_function":
            raise PlanError(f"node {n.name}: {n.op} nodes are not supported by the tensor-parallel runtime",
                            hint="plan this model without tensor parallelism (--tp 1)")
        if n.target is torch.ops.aten._assert_tensor_metadata.default and self.p.precision.low:
            return None  # export's check of the captured (fp32) dtype: the policy computes in another
        try:
            out = self._run_op(n, d, args, kwargs)
        except Exception as e:
            raise RuntimeError(f"tensor-parallel node {n.format_node()} (strategy {d.strategy!r}, "
                               f"module {d.module or '<root>'}) failed on tp rank {self.p.tp.rank}: {e}") from e
        self.p.check_shapes(n, d, out)
        if access is not None and reads:
            access.used_params(reads, out)
            done = self.p.param_last_reads.get(n.name)
            if done:
                access.release_params(done, out)
        return out

    def _local_args(self, n: torch.fx.Node, d: NodeDecision) -> tuple[list, dict]:
        j = 0
        getitem = n.target is operator.getitem

        def fetch(a: torch.fx.Node) -> Any:
            nonlocal j
            v = self.env[a]
            if not _tensors(a.meta.get("val")):
                return v
            lay = d.ins[j]
            j += 1
            return v if getitem else _edge(self.p.tp, v, lay)

        args = list(torch.fx.map_arg(n.args, fetch))
        kwargs = dict(torch.fx.map_arg(n.kwargs, fetch))
        if j != len(d.ins):
            raise PlanError(f"node {n.name}: the plan lists {len(d.ins)} tensor inputs, the graph has {j}",
                            hint="recompile the plan for this model with `partita compile`")
        if getitem:
            args = [_edge(self.p.tp, args[0][args[1]], d.ins[0])]
        return args, kwargs

    def _run_op(self, n: torch.fx.Node, d: NodeDecision, args: list, kwargs: dict) -> Any:
        g = self.p.tp
        name = _packet(n)
        if name == "getitem":
            return args[0]
        local = _LOCAL_OPS.get((name, d.strategy))
        if local is not None:
            return local(g, n, args, kwargs)
        val = n.meta.get("val")
        if name in _SIZE_ARG:
            args[1] = list(local_shape(val.shape, d.out[0], g.size))
        elif name == "unflatten":
            dim = args[1] % val.dim()
            args[2] = list(local_shape(val.shape, d.out[0], g.size))[dim:dim + len(args[2])]
        if self.p.rng is not None and is_random(n.target):
            base, dp_rank = self.p.rng
            sharded = _shard_dim(d.out[0]) is not None if d.out else False
            seed = op_seed(base, n.name, FLIGHT.step, FLIGHT.micro_batch, dp_rank, g.rank if sharded else None)
            with seeded(seed, self.p.device):
                return n.target(*args, **kwargs)
        if name == "view" and not _viewable(args[0], args[1]):
            # The captured program's input was laid out so that it could be viewed (a `.contiguous()`
            # that was a no-op there is not in the graph); a resharded local tensor may not be: copy.
            out = torch.ops.aten.reshape.default(args[0], args[1])
        else:
            out = n.target(*args, **kwargs)
        if name == "mean" and d.out[0] == "partial" and _shard_dim(d.ins[0].need) is not None:
            out = out / g.size  # the local mean over a sharded dim, divided as by the global count
        return out


def _viewable(t: torch.Tensor, shape: list[int]) -> bool:
    """Whether ``t.view(shape)`` works (its strides allow it without a copy)."""
    try:
        t.view(shape)
        return True
    except RuntimeError:
        return False


class TensorParallel(nn.Module):
    """This rank's part of a tensor-parallel plan: local parameter shards and the local program.

    ``forward(*inputs, targets)`` runs one micro-batch (inputs and targets whole,
    replicated on the TP group) and returns the loss, equal on every TP rank.
    Parameters come from ``module`` (its real weights are sliced, then the module's
    tensors move to the meta device) or, when ``checkpoint`` is given, from a
    ``torch.save``d state dict read with ``mmap=True`` so only each slice is read:
    ``module`` may then live on the meta device.
    """

    def __init__(self, module: nn.Module, plan: Plan, group: dist.ProcessGroup | None, *,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None, counter: CollectiveCounter,
                 device: torch.device, checkpoint: str | Path | None = None,
                 keep: Callable[[torch.fx.Node], bool] | None = None) -> None:
        super().__init__()
        self.tp = TPGroup(group, counter)
        self.plan = plan
        self.device = device
        self.decisions = {d.name: d for d in plan.nodes}
        captured = _capture(module, plan, loss_fn)  # dropped after loading: it holds the lifted constants
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
        self._held = {n.name for n in graph.nodes if n.op == "placeholder" and (
            keep is None or any(u.name in kept for u in n.users)
            or (not n.users and same.get(n.name, n.name) not in read and keep(n)))}
        state = open_weights(checkpoint) if checkpoint is not None else None
        self.shards = nn.ParameterDict()
        self.placements: dict[str, str] = {}  # qualified parameter name -> tp placement
        self._buffers_by_node: dict[str, torch.Tensor] = {}
        self._param_by_node: dict[str, str] = {}  # placeholder -> key in self.shards
        self._load(module, captured, state)
        if state is None:
            module.to("meta")  # drop the full tensors: this rank keeps only its slices
        self.param_access: ParamAccess | None = None  # set by compose under ZeRO-3
        self.rng: tuple[int, int] | None = None  # (run seed, dp rank): random ops seeded per op (runtime/rng.py)
        self.precision = FP32  # the plan's precision policy, set by compose: forward runs under its autocast
        self.param_reads, self.param_last_reads = self._param_readers()
        self.recomputed = recomputed_layers(plan)  # node -> layer, on the stages that recompute
        self._regions: dict[tuple[str, ...], list[torch.fx.Node | Region]] = {}

    def regions(self, nodes: list[torch.fx.Node]) -> list[torch.fx.Node | Region]:
        """``nodes`` with their recomputed layers grouped (``recompute_regions``), once per node list."""
        if not self.recomputed:  # nothing recomputes: every micro-batch runs the list as it is
            return nodes
        key = tuple(n.name for n in nodes)
        if key not in self._regions:
            self._regions[key] = recompute_regions(nodes, self.recomputed)
        return self._regions[key]

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

    # -- construction ---------------------------------------------------------------

    def _check_graph(self, captured: CapturedModel) -> None:
        names = [n.name for n in captured.graph_module.graph.nodes]
        missing = [n for n in names if n not in self.decisions]
        if missing:
            raise PlanError(
                f"the plan has no tensor-parallel decision for {len(missing)} of the {len(names)} nodes of "
                f"this model's training graph (first: {', '.join(missing[:3])})",
                hint="recompile the plan for this model (and loss) with `partita compile`",
            )

    def _placement(self, node: str, qualified: str) -> str:
        """Where the parameter lives: its placeholder's placement (``check_layouts`` checked that
        the plan's parameter layout says the same)."""
        return self.decisions[node].out[0]

    def _load(self, module: nn.Module, captured: CapturedModel, state: dict | None) -> None:
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        used = {n.name for n in captured.graph_module.graph.nodes if n.users}
        # a tied parameter can have several placeholders; the used ones say where it lives
        order = sorted(captured.param_nodes.items(), key=lambda kv: kv[0] not in used)
        for node, qualified in order:
            if node not in self._held:
                continue
            key = qualified.replace(".", "/")
            self._param_by_node[node] = key
            if key in self.shards:
                if node in used and self._placement(node, qualified) != self.placements[qualified]:
                    raise PlanError(f"tied parameter {qualified} has placeholders with different "
                                    f"placements ({node}: {self.decisions[node].out[0]}, "
                                    f"another: {self.placements[qualified]})",
                                        hint="recompile the plan for this model with `partita compile`")
                continue
            placement = self._placement(node, qualified)
            full = params[qualified] if state is None else _weight(state, qualified, params)
            d = _shard_dim(placement)
            piece = full.detach() if d is None else full.detach().chunk(self.tp.size, dim=d)[self.tp.rank]
            self.shards[key] = nn.Parameter(piece.to(self.device, copy=True).contiguous(),
                                            requires_grad=params[qualified].requires_grad)
            self.placements[qualified] = placement
        for node, qualified in captured.buffer_nodes.items():
            if node not in self._held:
                continue
            value = state.get(qualified) if state is not None else None
            if value is None:
                value = buffers.get(qualified)
            if value is None:
                value = captured.constants.get(qualified)
            if value is None or value.device.type == "meta" or isinstance(value, FakeTensor):
                raise PlanError(f"buffer {qualified} has no value: it is not in the checkpoint and the "
                                f"module holds no real tensor for it",
                                hint="save it in the checkpoint or build the module with real buffers")
            self.register_buffer(qualified.replace(".", "__"), value.detach().to(self.device, copy=True),
                                 persistent=False)
            self._buffers_by_node[node] = getattr(self, qualified.replace(".", "__"))

    # -- running -------------------------------------------------------------------------

    def local_parameters(self) -> dict[str, tuple[nn.Parameter, str]]:
        """Qualified name -> (this rank's shard, its tp placement)."""
        return {k.replace("/", "."): (p, self.placements[k.replace("/", ".")]) for k, p in self.shards.items()}

    def forward(self, *inputs: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        """One micro-batch through the whole graph: the loss (or, without a loss, the output)."""
        users = iter((*inputs, targets) if targets is not None else inputs)
        env = {n: self.placeholder_value(n, None if self.holds(n) else next(users))
               for n in self.graph_module.graph.nodes if n.op == "placeholder"}
        out = self.run_nodes(self.nodes, env)[self.nodes[-1]]
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
            raise PlanError(f"input {n.name} has shape {got}, but the plan's micro-batch is {want}", hint="pass batches of the plan's shape, or recompile for this shape")
        return user.to(self.device)

    def run_nodes(self, nodes: list[torch.fx.Node], env: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, Any]:
        """Run ``nodes`` (a subset of ``self.nodes``, in graph order) over ``env``; see ``_LocalInterpreter``."""
        with self.precision.autocast(self.device):
            return _LocalInterpreter(self).run_nodes(nodes, env)

    def check_shapes(self, n: torch.fx.Node, d: NodeDecision, out: Any) -> None:
        """Raise if a local output's shape is not the plan's (the global shape, sharded)."""
        expected = [local_shape(v.shape, p, self.tp.size) for v, p in zip(_tensors(n.meta.get("val")), d.out)]
        got = [tuple(v.shape) for v in _tensors(out)]
        if got != expected:
            raise PlanError(
                f"tensor-parallel node {n.format_node()} (strategy {d.strategy!r}, outputs {list(d.out)}) "
                f"produced local shapes {got} on tp rank {self.tp.rank}, the plan expects {expected}",
                hint="recompile the plan for this model with `partita compile`")


def _micro_batch_specs(plan: Plan) -> tuple[list[InputSpec], InputSpec | None]:
    """The plan's input and target specs with the batch dim set to the micro-batch size."""
    mbs = plan.training.micro_batch_size

    def micro(text: str) -> InputSpec:
        spec = parse_input_spec(text)
        return InputSpec(spec.name, spec.dtype, (mbs, *spec.shape[1:]))

    if not plan.model.inputs:
        raise PlanError("a tensor-parallel plan must record the model's inputs (plan.model.inputs)",
                        hint="recompile the plan for this model with `partita compile`")
    return [micro(s) for s in plan.model.inputs], micro(plan.model.targets) if plan.model.targets else None


def _capture(module: nn.Module, plan: Plan, loss_fn: Callable) -> CapturedModel:
    inputs, targets = _micro_batch_specs(plan)
    on_meta = any(t.device.type == "meta" for t in module.parameters())
    # A meta module is captured through fake tensors (export cannot run some models on meta);
    # its tensors are replaced by the local shards anyway.
    model = (lambda: module.to_empty(device="cpu")) if on_meta else module
    return capture(model, inputs, loss=loss_fn, targets=targets, name=plan.model.name)
