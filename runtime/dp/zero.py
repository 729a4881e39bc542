"""ZeRO over the dp axis: optimizer state (1), gradients (2) and parameters (3) sharded.

ZeRO acts on the rank's LOCAL parameters (its tensor-parallel shards, plain
``nn.Parameter``s), never on modules, so it works the same whether forward
runs eagerly or as an fx Interpreter over a captured graph. ``apply_zero`` is
compose's step for a plan with ZeRO (runtime/compose.py).

Parameters are grouped into flat buckets by the gradient-bucket rule of
runtime/dp/buckets.py (so the planner predicts these collectives from the same
``bucket_layout``), each padded to a multiple of dp elements; dp rank r owns one
contiguous slice of every bucket. The user's optimizer (elementwise: SGD, Adam, AdamW)
is built once, on one flat shard ``nn.Parameter`` per bucket.

Per step, over m micro-batches: stage 1 reduce-scatters each gradient bucket in the last
backward and all-gathers the parameters after the optimizer; stage 2 reduce-scatters after
every backward; stage 3 holds parameters only as shards, all-gathering a bucket before its
first use in forward and again in backward (``gather`` / ``release``, or the eager module
hooks). The counts are cost_model.zero_collectives'. How each stage works and composes with
TP, the pipeline's schedule and the rank's program: docs/runtime.md, "ZeRO at run time".

Frozen parameters (``requires_grad=False``) stay full and replicated and are
not counted. The parameters must already be equal across the dp group
(``compose`` broadcasts them first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from partita.core.precision import FP32, PrecisionPolicy
from partita.runtime.collectives import CollectiveCounter, all_gather_flat
from partita.runtime.dp.buckets import DEFAULT_BUCKET_BYTES, BucketReducer, GradBucket, bucket_members, grad_params
from partita.runtime.mixed_precision import MasterWeights, OptimizerFactory


class _FlatBucket(GradBucket):
    """A gradient bucket that also holds its members' data flat (``params_flat``) and the shard of
    it that this rank's optimizer updates."""

    def __init__(self, members: list[nn.Parameter], rank: int, size: int) -> None:
        super().__init__(members, rank, size)
        self.params_flat = torch.empty(0)  # (padded,) the members' data; stage 3 frees its storage
        self.shard: nn.Parameter | None = None  # (S,) what the optimizer updates
        self.pending: set[int] = set()  # stage 3 forward: members gathered and not yet released
        self.seen = False  # stage 3: gathered at least once in this forward
        self.gathering: dist.Work | None = None  # stage 3: a prefetch in flight into ``params_flat``


def _is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


class ZeroProgram:
    """ZeRO stage 1, 2 or 3 over the dp group for a list of local parameters.

    Per step the micro-batch loop calls (through runtime/step/sync.py ``Sharded``), for each
    micro-batch, ``begin_forward()`` BEFORE its forward, ``begin_backward(is_last)`` before its
    backward and ``after_backward()`` after it (``begin_micro_batch`` is the first two at once);
    then ``step()`` and ``zero_grad()``. Gradients must be
    scaled by the caller so that their mean over the dp ranks is the step's
    gradient (each bucket is divided by n before its sum reduce-scatter).
    Stage 3 also needs ``install_module_hooks(module)`` (eager) or
    ``gather`` / ``release`` around each use (an fx Interpreter).
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        stage: int,
        group: dist.ProcessGroup,
        *,
        optimizer_factory: OptimizerFactory,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        counter: CollectiveCounter | None = None,
        axis: str = "dp",
        precision: PrecisionPolicy = FP32,
        extra_params: Sequence[nn.Parameter] = (),
        units: Sequence[str] | None = None,
        offload: bool = False,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"zero stage={stage} must be 1, 2 or 3 (stage 0 is GradientAverager)")
        named = list(named_params)
        self.stage, self.group, self.axis = stage, group, axis
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.counter = counter if counter is not None else CollectiveCounter()
        self._by_name = {n: p for n, p in named}
        params = grad_params(p for _, p in named)
        # stage 3 by units (the plan's repeated layers): a layer a bucket, gathered ahead of its use
        unit = {id(p): u for (_, p), u in zip(named, units)} if stage == 3 and units is not None else None
        self.prefetch = unit is not None
        self.buckets = [_FlatBucket(m, self.rank, self.size) for m in bucket_members(
            params, bucket_bytes, [unit[id(p)] for p in params] if unit is not None else None)]
        self._order: list[_FlatBucket] = []  # stage 3: the buckets in the order a forward gathers them
        self._ordered = False  # that order is known (after the first forward)
        self._bucket_of: dict[int, _FlatBucket] = {id(p): b for b in self.buckets for p in b.members}
        self.shards: list[nn.Parameter] = []
        self._pinned = False  # inside gathered(): nothing is freed
        with torch.no_grad():
            for b in self.buckets:
                b.shard = self._setup_bucket(b)
                self.shards.append(b.shard)
        # stage 1 keeps full gradients between micro-batches (persistent buckets, reduced in the
        # last backward); stages 2-3 reduce every backward's, from transient buckets
        self.reducer = BucketReducer(self.buckets, group, collective="reduce_scatter", persistent=stage == 1,
                                     counter=self.counter, axis=axis, reduce_dtype=precision.reduce_dtype,
                                     on_launch=self._after_launch)
        # the one optimizer: on the shards' fp32 masters under mixed precision, and on
        # ``extra_params`` (whole parameters compose averages apart, e.g. tied across stages)
        self.precision = precision
        self.master = MasterWeights([*self.shards, *extra_params], optimizer_factory, precision,
                                     chunk_bytes=bucket_bytes, offload=offload)
        self.optimizer = self.master.optimizer

    def _setup_bucket(self, b: _FlatBucket) -> nn.Parameter:
        """Lay the bucket out flat; return the shard the optimizer updates."""
        flat = b.flatten_data()  # (padded,)
        b.view_params_into(flat)
        b.params_flat = flat
        if self.stage == 3:
            shard = nn.Parameter(flat[b.own].clone())
            shard.grad = torch.zeros_like(shard)
            self._free_params(b, park=True)
            return shard
        shard = nn.Parameter(flat[b.own])  # a view: the optimizer updates the full parameters in place
        if self.stage == 1:
            b.attach_grads()  # the members' .grad: views of the persistent flat gradient
            shard.grad = b.grad_flat[b.own]
        else:
            shard.grad = torch.zeros_like(shard)
        return shard

    # -- backward: gradients -------------------------------------------------------------

    def begin_micro_batch(self, is_last: bool) -> None:
        """Before a micro-batch's forward, when its backward follows it (no pipeline): both
        ``begin_forward`` and ``begin_backward``; stage 1 communicates only in the last one."""
        self.begin_forward()
        self.begin_backward(is_last)

    def begin_forward(self) -> None:
        """Before each micro-batch's forward (stage 3 tracks which buckets it has gathered, and
        learns from the first forward the order it gathers them in, which prefetching follows)."""
        if self.stage == 3:
            self._ordered = self._ordered or bool(self._order)
            for b in self.buckets:
                b.seen = False

    def begin_backward(self, is_last: bool) -> None:
        """Before each micro-batch's backward. A pipeline schedule calls it apart from
        ``begin_forward``: under 1F1B other micro-batches' forwards run in between."""
        self.reducer.begin(sync=is_last or self.stage >= 2)

    @property
    def launched_in_backward(self) -> int:
        """Buckets of the last backward whose reduce-scatter a gradient hook launched (overlapped)."""
        return self.reducer.launched_in_backward

    def _after_launch(self, b: _FlatBucket) -> None:
        if self.stage == 3:
            self._free_params(b, park=False)  # backward is done with them (autograd may still hold views)

    def after_backward(self) -> None:
        """After each micro-batch's backward: finish its reduce-scatters (stage 1: the last one's)."""
        if not self.reducer.finish():
            return
        for b, shard in zip(self.buckets, self.shards):
            if self.stage >= 2:
                shard.grad += b.reduced
                b.reduced = None
                for p in b.members:
                    p.grad = None
            if self.stage == 3:
                self._free_params(b, park=True)

    # -- the step --------------------------------------------------------------------------

    def step(self, inv_scale: float = 1.0, frozen: Sequence[nn.Parameter] = ()) -> None:
        """The optimizer on this rank's shards (their masters); stages 1-2 then all-gather the full
        parameters. ``frozen``: members no rank gave a gradient this step (``BucketReducer.unreached``),
        whose slices of the shards, and of the optimizer's state, are left as they were, as one
        process's optimizer skips a parameter without a gradient (the flat shard cannot)."""
        kept = self._snapshot(frozen)
        self.master.step(inv_scale)
        with torch.no_grad():
            for shard, master, part, values in kept:
                for t, v in zip([master, *self.optimizer.state.get(master, {}).values()], values):
                    if isinstance(t, torch.Tensor) and t.shape == master.shape:
                        t[part] = v
                if shard is not master:
                    shard[part] = master[part].to(shard.dtype)
        self.shards_to_params()

    def _snapshot(self, frozen: Sequence[nn.Parameter]) -> list[tuple]:
        """(shard, master, slice, copies of the master's and its state's slices) of each ``frozen``
        member's part of this rank's shard."""
        out = []
        for p in frozen:
            b = self._bucket_of.get(id(p))
            if b is None:
                continue
            offset = b.offsets[b.index[id(p)]]
            numel = int(torch.Size(b.shapes[b.index[id(p)]]).numel())
            lo, hi = max(offset, b.own.start), min(offset + numel, b.own.stop)
            if lo >= hi:
                continue
            part = slice(lo - b.own.start, hi - b.own.start)
            master = self.master.master_of(b.shard)
            tensors = [master, *self.optimizer.state.get(master, {}).values()]
            out.append((b.shard, master, part, [t[part].clone() if isinstance(t, torch.Tensor)
                                               and t.shape == master.shape else None for t in tensors]))
        return out

    def shards_to_params(self) -> None:
        """Stages 1-2: every rank's shard all-gathered into the full parameters (stage 3 holds
        only the shards)."""
        if self.stage == 3:
            return
        works = []
        for b, shard in zip(self.buckets, self.shards):
            works.append(all_gather_flat(b.params_flat, shard.detach(), group=self.group, async_op=True))
            self.counter.record("all_gather", self.axis, b.nbytes)
        with self.counter.blocking("all_gather", self.axis):
            for w in works:
                w.wait()

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.reducer.zero_grad()
            return
        self.reducer.touched.clear()
        for shard in self.shards:
            shard.grad.zero_()

    # -- stage 3: parameters gathered around their use -------------------------------------

    def _materialize(self, b: _FlatBucket) -> None:
        """``b``'s parameters whole: its prefetch waited for, or gathered now if freed."""
        if b.gathering is not None:
            with self.counter.blocking("all_gather", self.axis):
                b.gathering.wait()
            b.gathering = None
            b.view_params_into(b.params_flat)
            return
        if not _is_freed(b.params_flat):
            return
        b.params_flat.untyped_storage().resize_(b.nbytes)
        with torch.no_grad(), self.counter.blocking("all_gather", self.axis):
            all_gather_flat(b.params_flat, b.shard.detach(), group=self.group)
        self.counter.record("all_gather", self.axis, b.nbytes)
        b.view_params_into(b.params_flat)

    def _prefetch(self, b: _FlatBucket | None) -> None:
        """Start gathering ``b`` (if freed) without waiting: it arrives while the unit before it computes."""
        if b is None or b.gathering is not None or not _is_freed(b.params_flat):
            return
        b.params_flat.untyped_storage().resize_(b.nbytes)
        with torch.no_grad():
            b.gathering = all_gather_flat(b.params_flat, b.shard.detach(), group=self.group, async_op=True)
        self.counter.record("all_gather", self.axis, b.nbytes)

    def _neighbour(self, b: _FlatBucket, step: int) -> _FlatBucket | None:
        """The bucket after ``b`` in forward order (``step`` 1) or before it (-1, backward's next)."""
        if not (self.prefetch and self._ordered) or b not in self._order:
            return None
        i = self._order.index(b) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _free_params(self, b: _FlatBucket, *, park: bool) -> None:
        """Free a gathered bucket. The storage is released but kept (resized to 0), so the views
        autograd saved in forward see the bucket again once backward gathers it; ``park`` (when no
        backward can need them) also points the parameters at an empty tensor, so that stray use
        fails with a shape error instead of reading freed memory."""
        if self._pinned:
            return
        if b.gathering is not None:  # a prefetch not used (it was not needed after all)
            b.gathering.wait()
            b.gathering = None
        b.params_flat.untyped_storage().resize_(0)
        if park:
            for p in b.members:
                p.data = b.params_flat[:0]

    def _gather_ids(self, ids: Iterable[int]) -> None:
        for b in self._buckets_of(ids):
            if _is_freed(b.params_flat) or b.gathering is not None:
                self._materialize(b)
                b.pending = set(b.ids) if not b.seen else set(ids) & b.ids
                if not b.seen and not self._ordered and b not in self._order:
                    self._order.append(b)
                b.seen = True
                if torch.is_grad_enabled() or not self._ordered:
                    self._prefetch(self._neighbour(b, 1))

    def _release_ids(self, ids: Iterable[int], outputs: object) -> None:
        buckets = self._buckets_of(ids)
        for b in buckets:
            b.pending -= set(ids)
            if not b.pending and not _is_freed(b.params_flat):
                self._free_params(b, park=not torch.is_grad_enabled())
        self._gather_in_backward(buckets, outputs)

    def _gather_in_backward(self, buckets: list[_FlatBucket], outputs: object) -> None:
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(outputs) if t.requires_grad]
            if tensors:  # the first gradient into these outputs precedes the backward that needs the parameters
                register_multi_grad_hook(tensors, lambda _: self._backward_needs(buckets), mode="any")

    def _backward_needs(self, buckets: list[_FlatBucket]) -> None:
        for b in buckets:
            self._materialize(b)
            self._prefetch(self._neighbour(b, -1))  # backward runs the units in reverse

    def _buckets_of(self, ids: Iterable[int]) -> list[_FlatBucket]:
        if self.stage != 3:
            raise RuntimeError(f"gather/release are for ZeRO stage 3; this is stage {self.stage}")
        out: list[_FlatBucket] = []
        for i in ids:
            b = self._bucket_of.get(i)
            if b is not None and b not in out:
                out.append(b)
        return out

    def gather(self, name: str) -> nn.Parameter:
        """The full parameter ``name`` (gathered if it is not), for an executor to use in forward."""
        p = self._by_name[name]
        self._gather_ids([id(p)])
        return p

    def release(self, names: Sequence[str], outputs: object) -> object:
        """Forward is done with ``names``: free their buckets once all members are released, and
        gather them again when backward reaches ``outputs`` (the tensors computed from them)."""
        self._release_ids([id(self._by_name[n]) for n in names], outputs)
        return outputs

    # The program's side (runtime/tp/program.py's ``ParamAccess``): by Parameter object,
    # per graph node. A node's backward needs the parameters it read, so every reader hooks its
    # outputs; only the last reader in forward releases them.

    def gather_params(self, params: Sequence[nn.Parameter]) -> None:
        """Before a graph node reads ``params``: their buckets gathered, if freed."""
        self._gather_ids([id(p) for p in params])

    def used_params(self, params: Sequence[nn.Parameter], outputs: object) -> None:
        """A node read ``params`` and made ``outputs``: gather again when backward reaches them."""
        self._gather_in_backward(self._buckets_of([id(p) for p in params]), outputs)

    def release_params(self, params: Sequence[nn.Parameter], outputs: object) -> None:
        """The last node of forward to read ``params`` made ``outputs``: release them."""
        self._release_ids([id(p) for p in params], outputs)

    def install_module_hooks(self, module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Eager stage 3: gather each module's own parameters before its forward, release after."""
        handles = []
        for m in module.modules():
            ids = [id(p) for p in m.parameters(recurse=False) if id(p) in self._bucket_of]
            if ids:
                handles.append(m.register_forward_pre_hook(lambda _m, _a, ids=ids: self._gather_ids(ids)))
                handles.append(m.register_forward_hook(lambda _m, _a, out, ids=ids: self._release_ids(ids, out)))
        return handles

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: every parameter full inside the block (to evaluate, compare or save); no-op otherwise."""
        if self.stage != 3:
            yield
            return
        for b in self.buckets:
            self._materialize(b)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for b in self.buckets:
                self._free_params(b, park=True)

    # -- introspection ---------------------------------------------------------------------

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """The averaged gradients of the step, full, by name (all-gathers every shard gradient)."""
        names = {id(p): n for n, p in self._by_name.items()}
        out = {}
        for b, shard in zip(self.buckets, self.shards):
            flat = b.new_flat()
            all_gather_flat(flat, shard.grad.detach(), group=self.group)
            self.counter.record("all_gather", self.axis, b.nbytes)
            out.update({names[id(p)]: g.clone() for p, g in zip(b.members, b.unflatten(flat))})
        return out

    @property
    def padding_elements(self) -> int:
        """Elements added to make every bucket a multiple of n (at most n - 1 per bucket)."""
        return sum(b.padded - b.numel for b in self.buckets)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: the tensors it keeps between steps, padding
        included; stage 3's transient gathered buckets are excluded (they are freed by then)."""
        def nbytes(ts: Iterable[torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        if self.stage == 3:
            params = nbytes(self.shards)
            grads = nbytes(s.grad for s in self.shards)
        else:
            params = nbytes(b.params_flat for b in self.buckets)
            grads = (nbytes(b.grad_flat for b in self.buckets) if self.stage == 1
                     else nbytes(s.grad for s in self.shards))
        masters = [self.master.master_of(s) for s in self.shards]
        optimizer = nbytes(t for m in masters for t in self.optimizer.state.get(m, {}).values()
                           if isinstance(t, torch.Tensor))
        if self.master.separate:
            optimizer += nbytes(masters)  # fp32 master weights, counted with the optimizer state (ZeRO's K)
        return {"params": params, "grads": grads, "optimizer": optimizer}


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def apply_zero(
    named_params: Iterable[tuple[str, nn.Parameter]],
    stage: int,
    dp_group: dist.ProcessGroup,
    *,
    optimizer_factory: OptimizerFactory,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    counter: CollectiveCounter | None = None,
    axis: str = "dp",
    precision: PrecisionPolicy = FP32,
    extra_params: Sequence[nn.Parameter] = (),
    units: Sequence[str] | None = None,
    offload: bool = False,
) -> ZeroProgram:
    """Shard these local parameters' model state over ``dp_group`` as ZeRO ``stage`` says.

    ``named_params`` is e.g. ``module.named_parameters()`` after tensor parallelism
    (the names are what ``gather``/``release`` take). The optimizer is built here
    by ``optimizer_factory`` on the flat shards; use ``program.optimizer``. ``units``: stage 3's
    unit of each parameter (core/buckets.py ``unit_of``), one bucket each, gathered ahead of use.
    """
    return ZeroProgram(named_params, stage, dp_group, optimizer_factory=optimizer_factory,
                       bucket_bytes=bucket_bytes, counter=counter, axis=axis, precision=precision,
                       extra_params=extra_params, units=units, offload=offload)
