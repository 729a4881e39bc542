"""Tensor parallelism's collectives: the "tp" group, and one plan edge as an autograd Function.

Placements (see core/tp/strategies.py): "replicate", "shard(D)" (rank r holds
the r-th of t equal slices of dim D), "partial" (the ranks' tensors sum to the
value). ``reshard`` turns a local tensor from one placement into another with
the collective the plan names for that edge (``InputLayout.fwd`` / ``bwd``);
``Reshard`` runs ``fwd`` in forward and ``bwd`` on the gradient in backward.
Collective byte counts are the whole tensor's (the gathered / reduced tensor),
as in the plan, so ``core/tp/layout.tp_collectives`` predicts them call for
call and the ``CollectiveCounter`` checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from partita.core.mesh import MeshAxis
from partita.core.placement import shard_dim
from partita.core.plans.plan import InputLayout
from partita.runtime.collectives import CollectiveCounter, all_gather_flat, reduce_scatter_flat

TP = MeshAxis.TP.value


def local_shape(shape: torch.Size | tuple[int, ...], placement: str, t: int) -> tuple[int, ...]:
    """The shape a rank of ``t`` holds of a tensor of ``shape`` laid out as ``placement``."""
    out = list(shape)
    d = shard_dim(placement)
    if d is not None:
        out[d] //= t
    return tuple(out)


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
        return self.all_gather_start(x, dim)()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.reduce_scatter_start(x, dim)()

    def all_gather_start(self, x: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
        """Issue the all-gather of ``x`` along ``dim``; the returned call waits for it and gives the
        result (work in between overlaps it)."""
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((local.shape[0] * self.size, *local.shape[1:]))
        self._record("all_gather", out)
        work = None
        if self.group is None:  # a group of one
            out.copy_(local)
        else:
            work = all_gather_flat(out, local, group=self.group, async_op=True)
        return self._waiter("all_gather", work, lambda: out.movedim(0, dim))

    def reduce_scatter_start(self, x: torch.Tensor, dim: int) -> Callable[[], torch.Tensor]:
        """Issue the reduce-scatter of ``x`` along ``dim``; the returned call waits and gives the result."""
        whole = x.movedim(dim, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // self.size, *whole.shape[1:]))
        self._record("reduce_scatter", whole)
        work = None
        if self.group is None:  # a group of one
            out.copy_(whole)
        else:
            work = reduce_scatter_flat(out, whole, group=self.group, async_op=True)
        return self._waiter("reduce_scatter", work, lambda: out.movedim(0, dim))

    def _waiter(self, kind: str, work: Any, result: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def wait() -> torch.Tensor:
            if work is not None:
                with self.counter.blocking(kind, TP):
                    work.wait()
            return result()
        return wait

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
    s, d = shard_dim(src), shard_dim(dst)
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


class Edge:
    """One edge of the plan bound to this rank's TP group: what ``Reshard`` runs each way."""

    __slots__ = ("g", "fwd", "have", "need", "bwd", "grad", "grad_need")

    def __init__(self, g: TPGroup, lay: InputLayout) -> None:
        self.g = g
        self.fwd, self.have, self.need = lay.fwd, lay.have, lay.need
        self.bwd, self.grad, self.grad_need = lay.bwd, lay.grad, lay.grad_need


class Reshard(torch.autograd.Function):
    """One edge of the plan: ``fwd`` in forward, ``bwd`` on the gradient in backward
    (``Reshard.apply(x, edge)``, a node of the rank's program: runtime/tp/program.py)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, e: Edge) -> torch.Tensor:
        ctx.e = e
        out = reshard(e.g, x, e.fwd, e.have, e.need)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        e = ctx.e
        return reshard(e.g, grad, e.bwd, e.grad, e.grad_need), None


def reshard_edge(x: torch.Tensor, e: Edge) -> torch.Tensor:
    """``x`` (a node's input, as its producer placed it) as the node's strategy needs it, through
    ``Reshard``: a call the rank's generated program makes by name."""
    return Reshard.apply(x, e)
