"""Ops that a tensor-parallel strategy cannot run as the plain op on local pieces.

Most nodes run their aten op on the local tensors as they are. A few strategies
(core/tp/strategies.py names them) need their own local program: a
vocabulary-parallel embedding, softmax and cross-entropy, a row-parallel bias
added on tp rank 0 only, a batch-sharded cross-entropy divided by the global
count. Each implementation is registered under the (op, strategy) pairs it
serves with ``@local_op``, next to its code; the program builder
(runtime/tp/program.py) looks a node up with ``LOCAL_OPS.get((op, strategy))``.
``RegatheredLinear`` is the one keyed by an edge instead: a linear under sequence parallelism
that gathers its input itself (core/tp/layout.py ``regathers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from partita.core.placement import shard_dim
from partita.runtime.tp.collectives import Edge, TPGroup, reshard

LocalOp = Callable[[TPGroup, torch.fx.Node, list, dict], Any]
LOCAL_OPS: dict[tuple[str, str], LocalOp] = {}


def local_op(*keys: tuple[str, str]) -> Callable[[LocalOp], LocalOp]:
    """Register the decorated function as the local program of each (op, strategy) in ``keys``."""
    def register(fn: LocalOp) -> LocalOp:
        for key in keys:
            assert key not in LOCAL_OPS, f"two local programs for {key}"
            LOCAL_OPS[key] = fn
        return fn

    return register


def _rank0(g: TPGroup, b: torch.Tensor) -> torch.Tensor:
    """The bias on tp rank 0, zeros elsewhere (a partial sum adds it once); gradients flow on all."""
    return b * (1.0 if g.rank == 0 else 0.0)


@local_op(("embedding", "vocab"))
def _embedding_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    """Rows of a vocabulary-sharded table: ids outside this rank's range give zeros (a partial sum)."""
    w, idx = args[0], args[1]  # w (V/t, C), idx replicate
    rows = w.shape[0]
    lo = g.rank * rows
    mine = (idx >= lo) & (idx < lo + rows)
    local = torch.where(mine, idx - lo, torch.zeros_like(idx))
    pad = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    pad = pad - lo if pad is not None and 0 <= pad - lo < rows else -1
    out = torch.ops.aten.embedding.default(w, local, pad, *args[3:])
    return out * mine.unsqueeze(-1).to(out.dtype)


@local_op(("linear", "row"), ("addmm", "row"), ("conv2d", "row"))
def _row_bias(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    """A row-parallel layer's output is a partial sum: its bias is added on tp rank 0 only."""
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


@local_op(("_softmax", "vocab"), ("softmax", "vocab"), ("_log_softmax", "vocab"), ("log_softmax", "vocab"))
def _softmax_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    name = n.target.__name__.split(".")[0]
    x, dim = args[0], args[1] % args[0].dim()
    return _VocabSoftmax.apply(x, dim, "log" in name, g)


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


def _ignore_index(args: list, kwargs: dict) -> int:
    return args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)


@local_op(("cross_entropy_loss", "vocab"))
def _ce_vocab(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    return _VocabCrossEntropy.apply(args[0], args[1], g, _ignore_index(args, kwargs))


@local_op(("cross_entropy_loss", "shard(0)"))
def _ce_batch(g: TPGroup, n: torch.fx.Node, args: list, kwargs: dict) -> torch.Tensor:
    """This rank's rows: the sum of their losses over the global count (a partial mean)."""
    ignore = _ignore_index(args, kwargs)
    logits, targets = args[0], args[1]
    count = g.all_reduce((targets != ignore).sum())
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore, reduction="sum") / count


class _RegatheredLinear(torch.autograd.Function):
    """``linear(gather(x), w, b)`` that keeps ``x``, this rank's slice, for backward and gathers it
    again there (sequence parallelism's column-parallel linear, core/tp/layout.py ``regathers``):
    the gathered input lives only while the product runs. Backward is the linear's own (in the
    dtype forward computed in), its input gradient reduced back onto the slices by the edge's
    backward reshard."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, e: Edge, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.aten.linear.default(reshard(e.g, x, e.fwd, e.have, e.need), w, b)
        ctx.e, ctx.dtype, ctx.bias = e, out.dtype, b is not None
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None,
                                                         torch.Tensor | None]:
        x, w = ctx.saved_tensors
        e, g = ctx.e, ctx.e.g
        grad = grad.to(ctx.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        # Megatron-LM's order: the regather runs while the input's gradient is multiplied, and that
        # gradient's reduce-scatter while the weight's is (each wait only where the result is read)
        regather = g.all_gather_start(x, shard_dim(e.have)) if ctx.needs_input_grad[2] else None
        gx = gw = gb = None
        scatter = None
        if ctx.needs_input_grad[0]:
            whole = grad @ w.to(ctx.dtype)
            if e.bwd == "reduce_scatter":
                scatter = g.reduce_scatter_start(whole, shard_dim(e.grad_need))
            else:
                gx = reshard(g, whole, e.bwd, e.grad, e.grad_need).to(x.dtype)
        if regather is not None:
            inputs = regather().to(ctx.dtype)
            gw = (rows.t() @ inputs.reshape(-1, inputs.shape[-1])).to(w.dtype)
        if ctx.bias and ctx.needs_input_grad[3]:
            gb = rows.sum(0).to(w.dtype)
        if scatter is not None:
            gx = scatter().to(x.dtype)
        return gx, None, gw, gb


class RegatheredLinear:
    """A linear node whose activation input arrives by the plan edge ``e`` (an all-gather), run by
    ``_RegatheredLinear``: called by the rank's program with the node's local arguments."""

    def __init__(self, e: Edge) -> None:
        self.e = e

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return _RegatheredLinear.apply(x, self.e, w, b)
