"""The tensor-parallel interpreter: graph nodes run on this rank's LOCAL tensors as the plan says.

Each tensor input of a node is brought from the producer's placement
(``InputLayout.have``) to the one the node's strategy needs through
runtime/tp/collectives.py ``edge`` (the plan's ``fwd`` collective in forward, its ``bwd``
in backward); the op then runs on the local pieces, through a local program
when its (op, strategy) has one (runtime/tp/local_ops.py), with its size
arguments made local, random ops seeded per op (runtime/rng.py), and means
over a sharded dim divided by the global count. Every local output's shape is
checked against the plan; a mismatch raises naming the node. A recomputed
layer's nodes run as one region (runtime/tp/recompute.py).

Local tensors rather than DTensor: explicit control means the collectives run
are exactly the plan's, one per recorded reshard (and each op-internal one).

What the interpreter reads of the program it runs is ``LocalProgram``
(runtime/tp/module.py's ``TensorParallel`` is one); who holds the
parameters between their uses (ZeRO-3) answers to ``ParamAccess``.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.fx
from torch import nn

from partita.core.errors import PlanError
from partita.core.ops import tensor_values
from partita.core.placement import shard_dim
from partita.core.plan import NodeDecision
from partita.core.precision import PrecisionPolicy
from partita.runtime.rng import is_random, op_seed, seeded
from partita.runtime.tp.collectives import TPGroup, edge, local_shape
from partita.runtime.tp.local_ops import LOCAL_OPS
from partita.runtime.tp.recompute import Region, run_recomputed
from partita.runtime.watchdog import FLIGHT

_SIZE_ARG = frozenset({"view", "reshape", "_unsafe_view", "expand"})
# The captured graph is the training forward. In eval mode (``module.eval()``) the ops whose result
# depends on the mode run as PyTorch runs them in eval: their ``train`` argument (at this index)
# False, so dropout passes its input through and batch norm normalises by its running statistics.
_TRAIN_ARG = {"dropout": 2, "feature_dropout": 2, "alpha_dropout": 2, "feature_alpha_dropout": 2, "batch_norm": 5}


class ParamAccess(Protocol):
    """Who holds the parameters between their uses (ZeRO-3, runtime/dp/zero.py): the interpreter
    asks for a node's parameters before it runs and says when forward is done with them."""

    def gather_params(self, params: Sequence[nn.Parameter]) -> None: ...

    def used_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...

    def release_params(self, params: Sequence[nn.Parameter], outputs: Any) -> None: ...


class LocalProgram(Protocol):
    """What the interpreter reads of the program whose nodes it runs."""

    graph_module: torch.fx.GraphModule
    decisions: Mapping[str, NodeDecision]
    tp: TPGroup
    device: torch.device
    precision: PrecisionPolicy
    rng: tuple[int, int] | None  # (run seed, dp rank), or None: random ops draw from the user's generator
    param_access: ParamAccess | None
    param_reads: Mapping[str, list[nn.Parameter]]  # node -> the parameters it reads
    param_last_reads: Mapping[str, list[nn.Parameter]]  # node -> those forward is done with after it
    buffer_nodes: Mapping[str, str]  # buffer placeholder -> its name
    training: bool  # the module's mode: eval runs ``_TRAIN_ARG``'s ops as eval and updates no buffer


def op_name(n: torch.fx.Node) -> str:
    """The op a node calls, as ``LOCAL_OPS`` keys it ("linear", "getitem", ...)."""
    if n.target is operator.getitem:
        return "getitem"
    return getattr(n.target, "__name__", str(n.target)).split(".")[0]


def check_shapes(g: TPGroup, n: torch.fx.Node, d: NodeDecision, out: Any) -> None:
    """Raise if a local output's shape is not the plan's (the global shape, sharded)."""
    expected = [local_shape(v.shape, p, g.size) for v, p in zip(tensor_values(n.meta.get("val")), d.out)]
    got = [tuple(v.shape) for v in tensor_values(out)]
    if got != expected:
        raise PlanError(
            f"tensor-parallel node {n.format_node()} (strategy {d.strategy!r}, outputs {list(d.out)}) "
            f"produced local shapes {got} on tp rank {g.rank}, the plan expects {expected}",
            hint="recompile the plan for this model with `partita compile`")


class LocalInterpreter(torch.fx.Interpreter):
    """Runs graph nodes on local tensors as their decisions say; ``run_items`` runs a subset
    (one pipeline stage) over an environment the caller seeds with the values it needs."""

    def __init__(self, program: LocalProgram) -> None:
        super().__init__(program.graph_module, garbage_collect_values=True)
        self.p = program

    def run_items(self, items: Sequence[torch.fx.Node | Region], env: dict[torch.fx.Node, Any]
                  ) -> dict[torch.fx.Node, Any]:
        """Run ``items`` (nodes, no placeholders, and recomputed regions) in order; ``env`` holds
        every value they read from elsewhere and receives their outputs."""
        self.env = env
        for item in items:
            if isinstance(item, Region):
                self._run_region(item, env)
            else:
                env[item] = self.run_node(item)
        return env

    def _run_region(self, r: Region, env: dict[torch.fx.Node, Any]) -> None:
        """Run a recomputed layer's nodes (runtime/tp/recompute.py): their values live in a local
        environment, and only the outputs reach ``env``."""
        def forward(*values: Any) -> tuple[Any, ...]:  # also the rerun in backward
            outer = self.env
            self.env = local = dict(zip(r.inputs, values))
            try:
                for n in r.nodes:
                    local[n] = self.run_node(n)
            finally:
                self.env = outer
            return tuple(local[n] for n in r.outputs)

        outs = run_recomputed(forward, [env[a] for a in r.inputs])
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
        check_shapes(self.p.tp, n, d, out)
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
            if not tensor_values(a.meta.get("val")):
                return v
            lay = d.ins[j]
            j += 1
            return v if getitem else edge(self.p.tp, v, lay)

        args = list(torch.fx.map_arg(n.args, fetch))
        kwargs = dict(torch.fx.map_arg(n.kwargs, fetch))
        if j != len(d.ins):
            raise PlanError(f"node {n.name}: the plan lists {len(d.ins)} tensor inputs, the graph has {j}",
                            hint="recompile the plan for this model with `partita compile`")
        if getitem:
            args = [edge(self.p.tp, args[0][args[1]], d.ins[0])]
        return args, kwargs

    def _run_op(self, n: torch.fx.Node, d: NodeDecision, args: list, kwargs: dict) -> Any:
        g = self.p.tp
        name = op_name(n)
        if name == "getitem":
            return args[0]
        local = LOCAL_OPS.get((name, d.strategy))
        if local is not None:
            return local(g, n, args, kwargs)
        if not self.p.training:
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
        if self.p.rng is not None and is_random(n.target):
            base, dp_rank = self.p.rng
            sharded = shard_dim(d.out[0]) is not None if d.out else False
            seed = op_seed(base, n.name, FLIGHT.step, FLIGHT.micro_batch, dp_rank, g.rank if sharded else None)
            with seeded(seed, self.p.device):
                return n.target(*args, **kwargs)
        if name == "view" and not _viewable(args[0], args[1]):
            # The captured program's input was laid out so that it could be viewed (a `.contiguous()`
            # that was a no-op there is not in the graph); a resharded local tensor may not be: copy.
            out = torch.ops.aten.reshape.default(args[0], args[1])
        else:
            out = n.target(*args, **kwargs)
        if name == "mean" and d.out[0] == "partial" and shard_dim(d.ins[0].need) is not None:
            out = out / g.size  # the local mean over a sharded dim, divided as by the global count
        return out


def _viewable(t: torch.Tensor, shape: list[int]) -> bool:
    """Whether ``t.view(shape)`` works (its strides allow it without a copy)."""
    try:
        t.view(shape)
        return True
    except RuntimeError:
        return False
