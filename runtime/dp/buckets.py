"""Gradient buckets, overlapped with backward: the one mechanism behind data parallelism and ZeRO.

Layout (``bucket_members``, by core/buckets.py's ``pack_buckets``, the rule the
planner uses to predict the collectives: ``bucket_layout`` is the contract): the
parameters that require grad, each tied one once, walked in REVERSE ``module.parameters()``
order; a bucket closes once its bytes reach ``bucket_bytes`` or before a parameter of
another dtype.

A ``GradBucket`` holds its members' gradients in one flat tensor, padded so that each rank
owns one contiguous slice (``own``), either persistent (the ``.grad``s are views into it)
or transient (built from the ``.grad``s, which are then freed: ZeRO-2/3).
``BucketReducer`` runs one asynchronous collective per bucket as soon as its gradients are
accumulated, in index order on every rank: an all-reduce (data parallelism) or a
reduce-scatter (ZeRO), in the policy's ``reduce_dtype``; only a synchronising backward
communicates (``begin(sync)``), and ``finish`` waits for all. The rules in full:
docs/runtime.md, "Gradient buckets".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from partita.core.buckets import DEFAULT_BUCKET_BYTES, WHOLE_UNITS, pack_buckets
from partita.runtime.collectives import CollectiveCounter, reduce_scatter_flat


def grad_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Parameters that receive gradients, each once (tied parameters appear once), in order."""
    seen: set[int] = set()
    out = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def bucket_members(params: list[nn.Parameter], bucket_bytes: int,
                   units: list[str] | None = None) -> list[list[nn.Parameter]]:
    """``params`` (``grad_params``' list) cut into buckets by core/buckets.py's ``pack_buckets``
    (the planner's rule too), a dtype change closing a bucket; with ``units`` (ZeRO-3's unit of
    each parameter, core/buckets.py ``unit_of``) one bucket per run of a unit, whatever its size."""
    sizes = [p.numel() * p.element_size() for p in params]
    if units is not None:
        return [[params[i] for i in b]
                for b in pack_buckets(sizes, WHOLE_UNITS, [(p.dtype, u) for p, u in zip(params, units)])]
    return [[params[i] for i in b] for b in pack_buckets(sizes, bucket_bytes, [p.dtype for p in params])]


def bucket_layout(params: Iterable[nn.Parameter], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[int]:
    """Bytes of each gradient bucket, in the order the buckets are reduced (module docstring)."""
    return [sum(p.numel() * p.element_size() for p in b) for b in bucket_members(grad_params(params), bucket_bytes)]


class _Done:
    """The finished work of a collective over a group of one (no call is made)."""

    def wait(self) -> None:
        return None


_DONE = _Done()


class GradBucket:
    """One bucket's members as a flat tensor padded to ``size`` equal slices, of which rank
    ``rank`` owns one (``own``)."""

    def __init__(self, members: list[nn.Parameter], rank: int = 0, size: int = 1) -> None:
        self.members = members
        self.ids = frozenset(id(p) for p in members)
        self.numel = sum(p.numel() for p in members)
        self.shard_numel = -(-self.numel // size)  # S = ceil(N / n)
        self.padded = self.shard_numel * size
        self.dtype, self.device = members[0].dtype, members[0].device
        self.elem = members[0].element_size()
        self.own = slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)
        self.index = {id(p): i for i, p in enumerate(members)}
        self.shapes = [p.shape for p in members]  # ZeRO-3 parks the parameters as empty tensors
        self.offsets = []
        offset = 0
        for p in members:
            self.offsets.append(offset)
            offset += p.numel()
        self.grad_flat: torch.Tensor | None = None  # (padded,) the members' gradients
        self.grad_views: list[torch.Tensor] = []  # persistent: the members' .grad, views of grad_flat
        self.ready: set[int] = set()  # members whose gradient this backward has produced
        self.work: dist.Work | None = None
        self.wire: torch.Tensor | None = None  # the gradient bucket upcast to the reduce dtype, while reduced
        self.reduced: torch.Tensor | None = None  # transient: this rank's reduced slice (shard_numel,), settled

    @property
    def nbytes(self) -> int:
        return self.padded * self.elem

    def new_flat(self) -> torch.Tensor:
        return torch.zeros(self.padded, dtype=self.dtype, device=self.device)

    def flatten_data(self) -> torch.Tensor:
        flat = self.new_flat()
        for p, o in zip(self.members, self.offsets):
            flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def view_params_into(self, flat: torch.Tensor) -> None:
        """Make each member's data a view of ``flat`` (same Parameter objects, same storage)."""
        for p, v in zip(self.members, self.unflatten(flat)):
            p.data = v

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + s.numel()].view(s) for s, o in zip(self.shapes, self.offsets)]

    def attach_grads(self) -> None:
        """Persistent: every member's ``.grad`` a view of the flat gradient (allocated once)."""
        if self.grad_flat is None:
            self.grad_flat = self.new_flat()
            self.grad_views = self.unflatten(self.grad_flat)
        for p, g in zip(self.members, self.grad_views):
            p.grad = g


class BucketReducer:
    """One asynchronous collective per bucket over ``group``, overlapped with backward (module
    docstring): ``"all_reduce"`` or ``"reduce_scatter"``, of ``persistent`` or transient flat
    gradients. ``begin(sync)`` before each backward, ``finish()`` after it (or after the last
    of a step); ``on_launch(bucket)`` runs once a bucket's collective is launched."""

    def __init__(self, buckets: list[GradBucket], group: dist.ProcessGroup, *, collective: str,
                 persistent: bool, counter: CollectiveCounter, axis: str,
                 reduce_dtype: torch.dtype | None = None,
                 on_launch: Callable[[GradBucket], None] | None = None, keep_wire: bool = False,
                 divisor: int | None = None) -> None:
        if collective not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"collective {collective!r} must be all_reduce or reduce_scatter")
        self.buckets, self.group, self.axis = buckets, group, axis
        self.size = dist.get_world_size(group)
        self.divisor = divisor or self.size  # what the sum is divided by: the group's size, for a mean over it
        self.collective, self.persistent = collective, persistent
        self.counter = counter
        self.reduce_dtype = reduce_dtype  # None: the gradients' own dtype
        self.on_launch = on_launch
        # persistent, reduced in another dtype: keep the mean in the wire for ``reduced_grads``
        # instead of rounding it back into the gradients (the data-parallel averager's choice)
        self.keep_wire = keep_wire
        self._bucket_of = {id(p): b for b in buckets for p in b.members}
        for b in buckets:
            if persistent:
                b.attach_grads()
            for p in b.members:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self.sync = False
        self.touched: set[int] = set()  # members a backward of this step gave a gradient, on this rank
        self._next = 0  # buckets launch strictly in index order, the same on every rank
        self.launched_in_backward = 0  # buckets of the last synchronising backward launched by a hook

    def begin(self, sync: bool) -> None:
        """Prepare for one backward; only a synchronising one communicates."""
        self.sync = sync
        self._next = 0
        self.launched_in_backward = 0
        for b in self.buckets:
            b.ready.clear()
            b.work = None
            b.wire = None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self.touched.add(id(p))
        if not self.sync:
            return
        b = self._bucket_of[id(p)]
        i = b.index[id(p)]
        if self.persistent:
            view = b.grad_views[i]
            if p.grad is not view:  # .grad was reset to None (e.g. by the user): bring it home
                if p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
        else:
            if b.grad_flat is None:
                b.grad_flat = b.new_flat()
            o = b.offsets[i]
            b.grad_flat[o : o + p.grad.numel()].copy_(p.grad.reshape(-1))
            p.grad = None  # the full gradient lives only until its bucket is built
        b.ready.add(id(p))
        while (self._next < len(self.buckets)
               and len(self.buckets[self._next].ready) == len(self.buckets[self._next].members)):
            self._launch(self.buckets[self._next])
            self._next += 1
            self.launched_in_backward += 1

    def _launch(self, b: GradBucket) -> None:
        if b.grad_flat is None:  # no gradient reached this bucket: it still joins the collective
            b.grad_flat = b.new_flat()
        if not self.persistent and self._next > 0:  # one transient bucket in flight at a time, as
            self._settle(self.buckets[self._next - 1])  # FSDP2 does: the previous settles first
        flat = b.grad_flat
        if self.reduce_dtype is not None and self.reduce_dtype != flat.dtype:  # e.g. bf16 summed in fp32
            flat = b.wire = flat.to(self.reduce_dtype)
            if not self.persistent:
                b.grad_flat = None  # the wire is the bucket now: the full gradient is not held twice
        flat.div_(self.divisor)
        if self.size == 1:  # a group of one (the experts' "edp" at ep = dp): its sum is its own, no call
            b.work = _DONE
        elif self.collective == "all_reduce":
            b.work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:
            b.work = reduce_scatter_flat(flat[b.own], flat, group=self.group, async_op=True)
        if self.size > 1:
            self.counter.record(self.collective, self.axis, flat.numel() * flat.element_size())
        if self.on_launch is not None:
            self.on_launch(b)

    def finish(self) -> bool:
        """After a synchronising backward: launch the buckets it never completed (unused
        parameters), wait for all, the means back in the gradients' dtype. Whether it synced."""
        if not self.sync:
            return False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for b in self.buckets:
            self._settle(b)
        self.sync = False
        return True

    def _settle(self, b: GradBucket) -> None:
        """Wait for ``b``'s collective and put its result where the caller reads it: persistent,
        the mean back in the flat gradient (all of it for an all-reduce, this rank's slice for a
        reduce-scatter); transient, this rank's slice alone in ``b.reduced``, the full bucket freed."""
        if b.work is None:
            return
        with self.counter.blocking(self.collective, self.axis):
            b.work.wait()
        b.work = None
        result = slice(None) if self.collective == "all_reduce" else b.own  # where the mean is
        if self.persistent:
            if b.wire is not None and self.keep_wire:
                return  # the mean stays in the wire (``reduced_grads``) until ``zero_grad``
            if b.wire is not None:
                b.grad_flat[result].copy_(b.wire[result])
        else:
            # the mean stays in the reduce dtype (fp32 beside bf16 gradients): the shard's fp32 gradient
            # adds it unrounded, as FSDP2's fp32 reduce leaves its sharded gradients
            source = b.wire if b.wire is not None else b.grad_flat
            b.reduced = source[result].clone()
            b.grad_flat = None
        b.wire = None

    def reduced_grads(self) -> dict[int, torch.Tensor]:
        """With ``keep_wire``, after a synchronising backward's ``finish``: each member's mean
        gradient in the reduce dtype, by ``id``, views of its bucket's wire; {} otherwise. The
        members' ``.grad`` then hold this rank's own sum: the mean is read here (the optimizer's
        masters and the gradient norm take it as it was reduced, fp32 for bf16 gradients, with
        no rounding to bf16 and back and no copy)."""
        out: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            if b.wire is not None and b.work is None:
                out.update((id(p), v) for p, v in zip(b.members, b.unflatten(b.wire)))
        return out

    def zero_grad(self) -> None:
        """Persistent: the flat gradients zeroed, the members' ``.grad`` views of them again."""
        self.touched.clear()
        for b in self.buckets:
            b.wire = None
            b.grad_flat.zero_()
            b.attach_grads()

    def unreached(self) -> list[nn.Parameter]:
        """The members no backward of this step gave a gradient on ANY rank of the group (a
        collective over it: one all-reduce of a flag per member). A bucket's reduce hands every
        member a gradient, zeros where none came; the optimizer must skip these instead (one
        process would: their ``.grad`` stays None, so no weight decay or momentum moves them)."""
        members = [p for b in self.buckets for p in b.members]
        flags = torch.tensor([id(p) in self.touched for p in members], dtype=torch.float32,
                             device=members[0].device if members else "cpu")
        if self.size > 1:
            self.counter.record("all_reduce", self.axis, flags.numel() * flags.element_size())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [p for p, f in zip(members, flags.tolist()) if not f]

    def unreached_here(self) -> bool:
        """Whether a member got no gradient on this rank in this step (``unreached`` then asks all)."""
        return any(id(p) not in self.touched for b in self.buckets for p in b.members)
