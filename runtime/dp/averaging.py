"""Data parallelism: replicas made equal, then gradients averaged over "dp", overlapped with backward.

``apply_data_parallel`` is compose's step for a plan without ZeRO
(runtime/compose.py): the replicas broadcast from dp rank 0 (ranks that built the
model under different seeds would otherwise train different replicas and
silently diverge, since averaged gradients cannot bring them together), then a
``GradientAverager`` on the local parameters.

``GradientAverager`` is the bucketed all-reduce of runtime/dp/buckets.py over
persistent, unpadded buckets: each parameter's ``.grad`` is a view into its
bucket, so a bucket is all-reduced in place with one collective and nothing is
copied back; earlier micro-batches just accumulate locally (DDP's ``no_sync``)
and the last one's backward launches each bucket as soon as it is complete.
The planner predicts the calls by the same rule (runtime/dp/buckets.py ``bucket_layout``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.collectives import CollectiveCounter
from partita.runtime.dp.buckets import DEFAULT_BUCKET_BYTES, BucketReducer, GradBucket, bucket_members, grad_params


class GradientAverager(BucketReducer):
    """Averages gradients over the dp process group, one async all-reduce per bucket.

    ``begin(sync)`` before each backward; ``finish()`` after the last one of a
    step, before the optimizer step; ``zero_grad()`` after the step.
    The average divides each bucket by the dp size before the sum all-reduce
    (as DDP does), so gradients equal their mean over the dp ranks; the engine
    scales each rank's loss so that this mean is the global-batch mean. Reduced
    in another dtype (bf16 gradients summed in fp32) with ``keep_wire``, the mean
    is not copied back into the gradients: the step reads it from ``reduced_grads``.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        counter: CollectiveCounter | None = None,
        axis: str = "dp",
        reduce_dtype: torch.dtype | None = None,
        keep_wire: bool = False,
        divisor: int | None = None,
    ) -> None:
        buckets = [GradBucket(m) for m in bucket_members(grad_params(params), bucket_bytes)]
        super().__init__(buckets, group, collective="all_reduce", persistent=True,
                         counter=counter if counter is not None else CollectiveCounter(), axis=axis,
                         reduce_dtype=reduce_dtype, keep_wire=keep_wire, divisor=divisor)


class Averagers:
    """Several averagers run as one (``GradientAverager``'s interface): under expert parallelism the
    dense parameters' over "dp" and the experts' over "edp" (runtime/compose.py), each rank
    launching them in one order."""

    def __init__(self, parts: list[GradientAverager]) -> None:
        self.parts = parts

    def begin(self, sync: bool) -> None:
        for a in self.parts:
            a.begin(sync)

    def finish(self) -> bool:
        return all([a.finish() for a in self.parts])

    def reduced_grads(self) -> dict[int, torch.Tensor]:
        return {k: v for a in self.parts for k, v in a.reduced_grads().items()}

    def zero_grad(self) -> None:
        for a in self.parts:
            a.zero_grad()

    def unreached(self) -> list[nn.Parameter]:
        return [p for a in self.parts for p in a.unreached()]

    def unreached_here(self) -> bool:
        return any(a.unreached_here() for a in self.parts)


def broadcast_replicas(module: nn.Module, group: dist.ProcessGroup, *,
                       apart: Iterable[torch.Tensor] = (), apart_group: dist.ProcessGroup | None = None) -> None:
    """Every parameter and buffer of ``module`` as dp rank 0 of ``group`` holds it; those in
    ``apart`` (a rank's own experts, which differ over "dp") as rank 0 of ``apart_group`` does."""
    apart = {id(t): t for t in apart}
    with torch.no_grad():
        for tensors, g in (([t for t in [*module.parameters(), *module.buffers()] if id(t) not in apart], group),
                           (list(apart.values()), apart_group)):
            if g is None:
                continue
            src = dist.get_global_rank(g, 0)
            for t in tensors:
                dist.broadcast(t.data, src=src, group=g)


def apply_data_parallel(params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, bucket_bytes: int,
                        counter: CollectiveCounter, axis: str, reduce_dtype: torch.dtype,
                        keep_reduced: bool = False, divisor: int | None = None) -> GradientAverager:
    """Compose's data-parallel step (the replicas already broadcast): ``params``' gradients
    averaged over ``group`` in buckets of ``bucket_bytes``, reduced in ``reduce_dtype``.
    ``keep_reduced``: the mean stays as reduced for the optimizer step to read
    (``reduced_grads``), where nothing reads the gradients between the reduce and the step."""
    return GradientAverager(params, group, bucket_bytes=bucket_bytes, counter=counter, axis=axis,
                            reduce_dtype=reduce_dtype, keep_wire=keep_reduced, divisor=divisor)


class BufferAverager:
    """The running statistics a training forward writes (batch norm's), averaged over "dp" after
    each step. Each replica computes them from its share of the batch, so they would drift apart
    between ranks; torch DDP broadcasts rank 0's, the mean keeps every share's (for a running mean
    with equal shares it is exactly the statistic of the whole batch). Which buffers: those the
    plan's graph writes (core/model/ops.py ``running_buffers``, the rule the plan's all-reduce is
    listed by), or on the eager path the running statistics of the batch-norm modules; one
    all-reduce per dtype."""

    def __init__(self, buffers: Iterable[torch.Tensor], group: dist.ProcessGroup, *, counter: CollectiveCounter,
                 axis: str) -> None:
        seen: set[int] = set()
        self.buffers = [b for b in buffers if not (id(b) in seen or seen.add(id(b)))]
        self.group, self.counter, self.axis = group, counter, axis
        self.size = dist.get_world_size(group)

    def sync(self) -> None:
        for dtype in sorted({b.dtype for b in self.buffers}, key=str):
            same = [b for b in self.buffers if b.dtype == dtype]
            flat = torch.cat([b.detach().reshape(-1) for b in same]).div_(self.size)
            self.counter.record("all_reduce", self.axis, flat.numel() * flat.element_size())
            with self.counter.blocking("all_reduce", self.axis):
                dist.all_reduce(flat, group=self.group)
            with torch.no_grad():
                for b, piece in zip(same, flat.split([b.numel() for b in same])):
                    b.copy_(piece.view_as(b))


def running_statistics(module: nn.Module) -> list[torch.Tensor]:
    """The running mean and variance of every batch-norm module that tracks them (the eager path's
    ``running_buffers``)."""
    return [t for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            for t in (m.running_mean, m.running_var) if t is not None and t.is_floating_point()]
