"""Expert parallelism at run time: an MoE layer's token rows sent to the ranks holding their experts.

Under a plan with ``mesh.ep > 1`` each rank of an expert group (core/mesh.py) holds ``E / ep``
consecutive experts of every MoE layer (core/experts.py finds the layers; runtime/state/weights.py
keeps the slice). In the rank's program (runtime/tp/program.py) the layer's first grouped matmul
reads ``dispatch``'s rows instead of the rank's own, and the last one's rows go back by ``combine``;
a per-row value the layer reads from outside it (a bias gathered by expert id) goes with the rows
(``carry``):

- ``Route``: from the rank's rows per expert (its offsets), one all-to-all of the counts tells each
  rank how many rows every peer sends to each of its experts; the rows then travel by one
  all-to-all with those uneven splits, and are put in expert order (the grouped matmul's layout:
  each expert's rows together), with the local offsets;
- ``dispatch`` / ``combine``: the rows there and back, each an autograd function whose backward
  is the other direction's all-to-all of the gradient, so a token's gradient returns to its rank
  and an expert's weight gradient sums every token routed to it over the group.

A rank's expert-weight gradient so holds the whole group's tokens: runtime/compose.py averages it
over the ranks holding the same experts ("edp") divided by all of dp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from partita.core.experts import ExpertRegion
from partita.core.mesh import MeshAxis, held_experts
from partita.runtime.collectives import CollectiveCounter

EP = MeshAxis.EP.value


class ExpertGroup:
    """This rank's expert group: its process group, size and place, and the counter of its calls."""

    def __init__(self, group: dist.ProcessGroup, counter: CollectiveCounter) -> None:
        self.group, self.counter = group, counter
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def experts(self, total: int) -> slice:
        """The experts this rank holds, of ``total`` (core/mesh.py ``held_experts``)."""
        held = held_experts(total, self.size, self.rank)
        return slice(held.start, held.stop)

    def exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """``x``'s rows, ``send[j]`` of them to rank j of the group in order, and ``recv[j]`` from each."""
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self.counter.record("all_to_all", EP, x.numel() * x.element_size())
        with self.counter.blocking("all_to_all", EP):
            dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out


def expert_order(recv: torch.Tensor) -> torch.Tensor:
    """The received rows in expert order: ``recv[j, i]`` rows come from peer j for local expert i,
    peer by peer, each peer's by expert; the grouped matmul wants each expert's rows together
    (a stable sort by expert, so each expert's rows stay in peer order)."""
    peers, per = recv.shape
    expert_of_row = torch.arange(per, device=recv.device).repeat(peers).repeat_interleave(recv.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


class Route:
    """Where one micro-batch's rows of one MoE layer go (module docstring), worked out from the
    rank's cumulative rows per expert ``offsets`` (E of them, as the grouped matmul takes them)."""

    def __init__(self, g: ExpertGroup, offsets: torch.Tensor) -> None:
        self.g = g
        ends = offsets.detach().to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert, this rank's
        per = counts.numel() // g.size
        send = counts.reshape(g.size, per)  # [peer, its local expert]
        recv = torch.empty_like(send)
        g.counter.record("all_to_all", EP, send.numel() * send.element_size())
        with g.counter.blocking("all_to_all", EP):
            dist.all_to_all_single(recv, send, group=g.group)  # [peer, my local expert]
        # the split sizes on the host: one copy (a device sync on a GPU) for both directions
        self.send, self.recv = torch.stack([send.sum(1), recv.sum(1)]).tolist()
        self.order = expert_order(recv)
        self.local_ends = recv.sum(0).cumsum(0).to(offsets.dtype)

    def there(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's rows (sorted by expert) -> the rows of its own experts, expert by expert."""
        return self.g.exchange(x, self.send, self.recv)[self.order]

    def back(self, y: torch.Tensor) -> torch.Tensor:
        """The rows of its own experts, expert by expert -> each row at its token's rank, in its place."""
        out = y.new_empty(y.shape)
        out[self.order] = y
        return self.g.exchange(out, self.recv, self.send)


class _Exchange(torch.autograd.Function):
    """Rows one way along a route (``there``: to their experts' ranks; else back), their gradients
    the other way in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, route: Route, there: bool) -> torch.Tensor:
        ctx.route, ctx.there = route, there
        return route.there(x) if there else route.back(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (ctx.route.back(grad) if ctx.there else ctx.route.there(grad)), None, None


def dispatch(g: ExpertGroup, rows: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Route]:
    """The program's node before an MoE layer's first grouped matmul: (the rows of this rank's
    experts, their offsets, the route that ``combine`` takes back)."""
    route = Route(g, offsets)
    return _Exchange.apply(rows, route, True), route.local_ends, route


def carry(values: torch.Tensor, route: Route) -> torch.Tensor:
    """A per-row value made from the rank's own rows (core/experts.py ``ExpertRegion.carried``: a
    bias gathered by expert id) sent along the rows' route, so it meets each row on its expert's rank."""
    return _Exchange.apply(values, route, True)


def combine(rows: torch.Tensor, route: Route) -> torch.Tensor:
    """The program's node after an MoE layer's last grouped matmul: its rows at their tokens' ranks."""
    return _Exchange.apply(rows, route, False)


class ExpertLayers:
    """The MoE layers of a rank's graph under expert parallelism, as the program builder reads
    them (runtime/tp/program.py): each grouped matmul's layer, and the nodes whose values hold
    this rank's own rows or experts (their shapes are not the plan's)."""

    def __init__(self, g: ExpertGroup, regions: list[ExpertRegion]) -> None:
        self.g = g
        self.region_of = {m: r for r in regions for m in r.matmuls}
        self.local = frozenset(n for r in regions for n in r.local)
        self.chain_of = {n: r for r in regions for n in r.chains}  # a weight's views on its way to a matmul
        self.carried: dict[str, tuple[ExpertRegion, set[str]]] = {}  # reading node -> its region, values it carries
        for r in regions:
            for reader, value, _ in r.carried:
                self.carried.setdefault(reader, (r, set()))[1].add(value)


# -- routing as it falls: `partita calibrate --router` ------------------------------------------------


def measure_routing(module: torch.nn.Module, args: tuple[Any, ...]) -> list[list[int]]:
    """Each MoE layer's rows per expert when ``module`` runs forward on ``args`` (a real batch),
    in the order the layers run (the graph's): read off the offsets every grouped matmul takes
    (core/experts.py), the same argument the planner finds the layers by. Loop-style experts run
    as grouped matmuls, as they are captured (core/model/moe_loops.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from partita.core.experts import is_grouped_mm_op
    from partita.core.model.moe_loops import traceable_experts

    class Routing(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: list[list[int]] = []
            self.last: torch.Tensor | None = None  # held, so a new layer's offsets are a new tensor

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            if is_grouped_mm_op(str(func)) and isinstance(offs, torch.Tensor) and offs is not self.last:
                self.last = offs  # one layer's grouped matmuls share its offsets: counted once
                ends = [int(x) for x in offs.tolist()]
                self.counts.append([b - a for a, b in zip([0] + ends[:-1], ends)])
            return func(*args, **kwargs)

    was = module.training
    module.eval()
    try:
        with torch.no_grad(), traceable_experts(module), Routing() as seen:
            module(*args)
    finally:
        module.train(was)
    return seen.counts
