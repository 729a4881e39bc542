"""Data parallelism: gradient averaging over the dp axis, overlapped with backward.

Gradients live in flat per-bucket buffers (each parameter's ``.grad`` is a view
into its bucket), so a bucket is all-reduced in place with one collective and
nothing is copied back. Buckets fill in reverse parameter order, roughly the
order backward produces gradients; as soon as every gradient of a bucket has
been accumulated (``register_post_accumulate_grad_hook``) the bucket is
averaged with an asynchronous all-reduce, so communication runs while backward
computes the earlier layers. ``finish`` waits for all of them before the
optimizer step.

Only a synchronising backward (the last micro-batch of a step) communicates;
earlier micro-batches just accumulate locally (DDP's ``no_sync``).

The bucket rule, which the planner reproduces on its own to predict the
collectives (see ``bucket_layout``), is the contract between the two.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from partita.core.buckets import DEFAULT_BUCKET_BYTES, pack_buckets  # noqa: F401 (re-exported)
from partita.runtime.watchdog import FLIGHT

# torch DDP's default bucket_cap_mb=25, in bytes.


@dataclass
class CollectiveCounter:
    """Collectives this rank issued: (kind, axis, bytes per call) -> calls."""

    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # (kind, axis) -> seconds blocked in such calls

    @contextlib.contextmanager
    def blocking(self, kind: str, axis: str) -> Iterator[None]:
        """Time a wait for a ``kind`` collective over ``axis`` (what a step spends in them, measured)."""
        t0 = time.perf_counter()
        yield
        self.seconds[(kind, axis)] += time.perf_counter() - t0

    def record(self, kind: str, axis: str, nbytes: int, ranks: tuple[int, ...] | None = None) -> None:
        """Count one call, and log it in the flight recorder the watchdog reads (``ranks``: its group,
        when not this rank's whole ``axis``)."""
        self.calls[(kind, axis, nbytes)] += 1
        FLIGHT.entered(kind, axis, nbytes, ranks)

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()

    def as_tuples(self) -> list[tuple[str, str, int, int]]:
        """Sorted (kind, axis, bytes, calls), comparable with a plan's ``collectives``."""
        return sorted((k, a, b, n) for (k, a, b), n in self.calls.items())


def grad_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters that receive gradients, each once (tied parameters appear once), in order."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _bucket_members(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` grouped by core/buckets.py's ``pack_buckets`` (the planner's rule too)."""
    sizes = [p.numel() * p.element_size() for p in params]
    return [[params[i] for i in b] for b in pack_buckets(sizes, bucket_bytes, [p.dtype for p in params])]


def bucket_layout(params: Iterable[nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket, in the order the buckets are all-reduced.

    The rule: take the parameters that require grad in ``module.parameters()``
    order (each tied parameter once), walk them in REVERSE, and append each to
    the open bucket; a bucket closes as soon as its bytes reach ``bucket_bytes``
    (so a bucket may exceed it by its last parameter, and one parameter larger
    than the cap is a bucket of its own), and a parameter of another dtype
    than the open bucket's closes that bucket first. The last, partial bucket
    closes at the end. Bytes are ``numel * element_size``.
    """
    return [sum(p.numel() * p.element_size() for p in b) for b in _bucket_members(grad_params(params), bucket_bytes)]


class _Bucket:
    def __init__(self, members: list[nn.Parameter]) -> None:
        self.members = members
        numel = sum(p.numel() for p in members)
        self.buffer = torch.zeros(numel, dtype=members[0].dtype, device=members[0].device)
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for p in members:
            self.views[id(p)] = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.nbytes = numel * self.buffer.element_size()
        self.ready: set[int] = set()
        self.work: dist.Work | None = None
        self.wire: torch.Tensor | None = None  # the bucket upcast to the reduce dtype, while it is reduced


class GradientAverager:
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
        self.group = group
        self.size = dist.get_world_size(group)
        self.axis = axis
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype
        self.counter = counter if counter is not None else CollectiveCounter()
        self.buckets = [_Bucket(m) for m in _bucket_members(grad_params(params), bucket_bytes)]
        self._bucket_of: dict[int, int] = {}
        for i, b in enumerate(self.buckets):
            for p in b.members:
                self._bucket_of[id(p)] = i
                p.grad = b.views[id(p)]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._sync = False
        self._next = 0  # buckets launch strictly in index order, the same on every rank
        self.launched_in_backward = 0  # buckets of the last step launched by a hook (overlapped)

    def begin(self, sync: bool) -> None:
        """Prepare for one backward; only a synchronising one communicates."""
        self._sync = sync
        if sync:
            self._next = 0
            self.launched_in_backward = 0
            for b in self.buckets:
                b.ready.clear()
                b.work = None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        b = self.buckets[self._bucket_of[id(p)]]
        view = b.views[id(p)]
        if p.grad is not view:  # .grad was reset to None (e.g. by the user): bring it home
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        b.ready.add(id(p))
        self._launch_ready()

    def _launch(self, b: _Bucket) -> None:
        wire = b.buffer
        if self.reduce_dtype is not None and self.reduce_dtype != wire.dtype:  # e.g. bf16 gradients summed in fp32
            wire = b.wire = wire.to(self.reduce_dtype)
        wire.div_(self.size)
        b.work = dist.all_reduce(wire, group=self.group, async_op=True)
        self.counter.record("all_reduce", self.axis, wire.numel() * wire.element_size())

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.members):
                return
            self._launch(b)
            self._next += 1
            self.launched_in_backward += 1

    def finish(self) -> None:
        """Launch buckets that backward never completed (unused parameters), then wait for all."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        with self.counter.blocking("all_reduce", self.axis):
            for b in self.buckets:
                if b.work is not None:
                    b.work.wait()
                    b.work = None
                if b.wire is not None:
                    b.buffer.copy_(b.wire)
                    b.wire = None
        self._sync = False

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            for p in b.members:
                p.grad = b.views[id(p)]
