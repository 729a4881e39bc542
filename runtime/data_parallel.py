"""Data parallelism: replicas made equal, then gradients averaged over "dp", overlapped with backward.

``apply_data_parallel`` is compose's step for a plan without ZeRO
(runtime/compose.py): the replicas broadcast from dp rank 0 (ranks that built the
model under different seeds would otherwise train different replicas and
silently diverge, since averaged gradients cannot bring them together), then a
``GradientAverager`` on the local parameters.

``GradientAverager`` is the bucketed all-reduce of runtime/grad_buckets.py over
persistent, unpadded buckets: each parameter's ``.grad`` is a view into its
bucket, so a bucket is all-reduced in place with one collective and nothing is
copied back; earlier micro-batches just accumulate locally (DDP's ``no_sync``)
and the last one's backward launches each bucket as soon as it is complete.
The planner predicts the calls from ``grad_buckets.bucket_layout``.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.collectives import CollectiveCounter
from partita.runtime.grad_buckets import (DEFAULT_BUCKET_BYTES, BucketReducer, GradBucket, bucket_members,
                                          grad_params)


class GradientAverager(BucketReducer):
    """Averages gradients over the dp process group, one async all-reduce per bucket.

    ``begin(sync)`` before each backward; ``finish()`` after the last one of a
    step, before the optimizer step; ``zero_grad()`` after the step.
    The average divides each bucket by the dp size before the sum all-reduce
    (as DDP does), so gradients equal their mean over the dp ranks; the engine
    scales each rank's loss so that this mean is the global-batch mean.
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
    ) -> None:
        buckets = [GradBucket(m) for m in bucket_members(grad_params(params), bucket_bytes)]
        super().__init__(buckets, group, collective="all_reduce", persistent=True,
                         counter=counter if counter is not None else CollectiveCounter(), axis=axis,
                         reduce_dtype=reduce_dtype)


def broadcast_replicas(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Every parameter and buffer of ``module`` as dp rank 0 of ``group`` holds it."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def apply_data_parallel(params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, bucket_bytes: int,
                        counter: CollectiveCounter, axis: str, reduce_dtype: torch.dtype) -> GradientAverager:
    """Compose's data-parallel step (the replicas already broadcast): ``params``' gradients
    averaged over ``group`` in buckets of ``bucket_bytes``, reduced in ``reduce_dtype``."""
    return GradientAverager(params, group, bucket_bytes=bucket_bytes, counter=counter, axis=axis,
                            reduce_dtype=reduce_dtype)
