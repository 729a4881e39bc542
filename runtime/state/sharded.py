"""Sharded checkpoints: this rank's training state in the whole model's coordinates, for DCP.

A checkpoint is torch.distributed.checkpoint's (DCP): each rank hands ``dcp.save`` /
``dcp.load`` only what it holds, described as pieces of the WHOLE tensors (a TP shard as
its ``torch.chunk``, a ZeRO range of a flat bucket as at most 2 * ndim rectangles:
``flat_range_pieces``), so a checkpoint saved under one plan loads under any other. Why,
and what a rank holds: docs/runtime.md, "Checkpoints".

The state dict (keys as in the unwrapped model's ``state_dict``, tied names
included, so ``dcp_to_torch_save`` gives a file the plain model loads with
``strict=True`` from its ``"model"`` entry):

    model/<name>            parameters and persistent buffers
    optim/<name>/<key>      optimizer state of the same shape (Adam's moments, momentum)
    optim/<name>/step       optimizer step counters (equal everywhere)
    rng/<rank>              each rank's CPU (and CUDA) generator states

(``dcp_to_torch_save`` returns the nested dict ``{"model": {...}, "optim": ...}``.) The step
count, the optimizer's hyperparameters, the LR scheduler's state, the user's ``extra``, the
fingerprint and every file's digest are in the completion marker, written last
(runtime/state/marker.py). A load checks it all before it changes anything: a failed load
leaves the model and the optimizer as they were.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.core.placement import shard_dim
from partita.runtime.distributed import _lost_a_peer  # the one rule for "a collective lost its peer"
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.program import Program
from partita.runtime.state import fingerprint
from partita.runtime.state.marker import CheckpointError, Writer, begin_save

Piece = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the whole tensor, the local data of that block)


def chunk_offset(n: int, parts: int, index: int) -> int:
    """Where ``torch.chunk(parts)``'s ``index``-th piece of a length-``n`` dim starts."""
    return min(n, index * -(-n // parts))


def flat_range_pieces(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as (offsets, sizes, flat start)
    rectangles, each contiguous in memory; at most 2 * ndim of them."""
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def go(dims: tuple[int, ...], prefix: tuple[int, ...], lo: int, hi: int, base: int) -> None:
        if lo >= hi:
            return
        if not dims:
            out.append((prefix, (1,) * len(prefix), base))
            return
        inner = math.prod(dims[1:])
        r0, c0 = divmod(lo, inner)
        r1, c1 = divmod(hi, inner)
        if r0 == r1:
            go(dims[1:], prefix + (r0,), c0, c1, base + r0 * inner)
            return
        if c0:
            go(dims[1:], prefix + (r0,), c0, inner, base + r0 * inner)
            r0 += 1
        if r1 > r0:
            out.append((prefix + (r0,) + (0,) * (len(dims) - 1), (1,) * len(prefix) + (r1 - r0,) + dims[1:],
                        base + r0 * inner))
        if c1:
            go(dims[1:], prefix + (r1,), 0, c1, base + r1 * inner)

    if not shape:
        return [((), (), 0)] if lo < hi else []
    go(tuple(shape), (), lo, hi, 0)
    return out


@dataclass
class _Held:
    """One parameter as this rank holds it."""

    names: list[str]  # its names in the model's state_dict (tied names share it)
    shape: tuple[int, ...]  # the whole tensor's
    origin: tuple[int, ...]  # where this rank's TP-local tensor starts in the whole tensor
    local_shape: tuple[int, ...]
    param: nn.Parameter  # the TP-local parameter (under ZeRO-3 its data is parked: use ``zero``)
    optimizer: torch.optim.Optimizer | None
    zero: tuple[Any, int] | None = None  # (bucket, the parameter's offset in it) under ZeRO


def _tensors_of(program: Program) -> Iterator[_Held]:
    """Every parameter this rank holds, with where it sits in the whole tensor."""
    plan, tp = program.plan, program.tp_module
    aliases = program.state_names
    local = program.local_parameters()
    t_rank, t_size = (tp.tp.rank, tp.tp.size) if tp is not None else (0, 1)
    shapes = {d.name: tuple(d.shape) for d in plan.params}
    zero = program.zero
    in_zero = {}
    if zero is not None:
        for b in zero.buckets:
            for p, offset in zip(b.members, b.offsets):
                in_zero[id(p)] = (b, offset)
    for name, (param, placement) in local.items():
        shape = shapes.get(name, tuple(param.shape))
        origin = [0] * len(shape)
        local_shape = list(shape)
        d = shard_dim(placement)
        if d is not None:
            origin[d] = chunk_offset(shape[d], t_size, t_rank)
            local_shape[d] = min(shape[d], origin[d] + -(-shape[d] // t_size)) - origin[d]
        if tp is not None and tp.experts is not None and name in tp.expert_params:
            held = tp.experts.g.experts(local_shape[0])  # this rank's experts (runtime/experts.py)
            origin[0] += held.start
            local_shape[0] = held.stop - held.start
        z = in_zero.get(id(param))
        opt = program.optimizer  # the one optimizer (ZeRO's, on its shards and any whole parameters)
        yield _Held(aliases.get(name, [name]), shape, tuple(origin), tuple(local_shape), param, opt, z)


class Pieces(torch.Tensor):
    """The blocks of a whole tensor that this rank holds, as DCP saves and loads them.

    A data-less tensor of the WHOLE shape that implements DCP's checkpointable protocol (the one
    DTensor implements): one write item / chunk per block, each block's data looked up by its
    offsets. Unlike a ShardedTensor it lists only this rank's blocks, as its plan needs no other
    rank's; unlike a DTensor it can describe ZeRO's ranges of flat buckets."""

    @staticmethod
    def __new__(cls, pieces: list[Piece], shape: tuple[int, ...]) -> Pieces:
        t = pieces[0][1]
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=t.dtype, device=t.device)
        self.pieces = {tuple(off): data for off, data in pieces}
        return self

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=data.shape),
                              properties=TensorProperties.create_from_tensor(data), size=self.size()))
                for off, data in self.pieces.items()]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=data.shape) for off, data in self.pieces.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"{func} on a checkpoint's block list: it holds no data of its own")


class _CopyStager:
    """``dcp.async_save``'s staging for ``Pieces``: a CPU copy of every block, taken before
    ``save_checkpoint`` returns, so training may change the parameters while the copy is written.
    ``buffers`` keeps the copies for the next save to copy into (periodic saves, each of which
    waits for the one before: no allocation, no page faults)."""

    _synchronize_after_execute = False

    def __init__(self, buffers: dict | None = None) -> None:
        self.buffers = buffers if buffers is not None else {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state: Any) -> Any:
        def into(key: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype)
            return buf.copy_(t.detach())

        def copy(key: tuple, v: Any) -> Any:
            if isinstance(v, dict):
                return {k: copy(key + (k,), x) for k, x in v.items()}
            if isinstance(v, Pieces):
                return Pieces([(off, into(key + (off,), d)) for off, d in v.pieces.items()], tuple(v.shape))
            if isinstance(v, torch.Tensor):
                return into(key, v)
            return v

        return copy((), state)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _sharded(pieces: list[Piece], shape: tuple[int, ...]) -> torch.Tensor:
    """``pieces`` of a whole tensor of ``shape`` as DCP takes them: the tensor itself when it is
    whole (identical replicas are then written once), else a ``Pieces``."""
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(shape):
        return pieces[0][1]
    return Pieces(pieces, shape)


def _pieces(h: _Held, flat: torch.Tensor | None, local: torch.Tensor) -> list[Piece]:
    """The blocks this rank holds: of ``local`` (the TP-local tensor), or under ZeRO of its part of
    ``flat``, this rank's flat shard of the parameter's bucket."""
    if h.zero is None:
        return [(h.origin, local.detach())]
    bucket, offset = h.zero
    own = bucket.own
    numel = math.prod(h.local_shape)
    lo, hi = max(offset, own.start), min(offset + numel, own.stop)
    out = []
    for off, sizes, start in flat_range_pieces(h.local_shape, lo - offset, hi - offset):
        at = offset + start - own.start
        data = flat.detach()[at:at + math.prod(sizes)].view(sizes)
        out.append((tuple(o + g for o, g in zip(off, h.origin)), data))
    return out


def training_state(program: Program, *, optimizer: bool = True) -> dict[str, Any]:
    """This rank's state dict for DCP (module docstring): views of what it holds, so copying into
    them is loading. ``optimizer``: with the optimizer's state (a fresh optimizer is given its
    state tensors first: ``init_optimizer_state``)."""
    opt = program.optimizer if optimizer else None
    if opt is not None:
        init_optimizer_state(opt)
    model_part: dict[str, Any] = {}
    optim_part: dict[str, Any] = {}
    updates = program.updates
    master = updates.master_of if updates is not None else (lambda t: t)  # fp32 masters under mixed precision
    for h in _tensors_of(program):
        shard = master(h.zero[0].shard) if h.zero is not None else None
        param = master(h.param)
        pieces = _pieces(h, shard, param)
        state = opt.state.get(shard if shard is not None else param, {}) if opt is not None else {}
        for name in h.names:
            if pieces:
                model_part[name] = _sharded(pieces, h.shape)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.dim() == 0:
                    optim_part[f"{name}/{key}"] = value
                    continue
                held = _pieces(h, value, value.view(h.local_shape) if h.zero is None else value)
                if held:
                    optim_part[f"{name}/{key}"] = _sharded(held, h.shape)
    for name, buf in program.persistent_buffers().items():
        model_part[name] = buf
    return {"model": model_part, "optim": optim_part, "rng": {str(program.ctx.rank): _rng_state()}}


def init_optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give a fresh optimizer its state tensors (a step at lr 0 over zero gradients), so that a
    checkpoint can be loaded into them; an optimizer that has stepped is left alone. Returns the
    parameters given state (``drop_state`` takes it back)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    fresh = [p for p in params if p not in opt.state]
    if not fresh:
        return []
    saved = [(g, g.get("lr")) for g in opt.param_groups]
    grads = {}
    for p in params:
        grads[p] = p.grad
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    with torch.no_grad():
        before = [p.detach().clone() for p in params]
        for g in opt.param_groups:
            g["lr"] = 0.0
        opt.step()
        for p, b in zip(params, before):  # weight decay at lr 0 leaves them, but be exact
            p.copy_(b)
    for g, lr in saved:
        g["lr"] = lr
    for p, g in grads.items():
        if g is None:
            p.grad = None
    return fresh


def drop_state(opt: torch.optim.Optimizer, fresh: list[torch.Tensor]) -> None:
    for p in fresh:
        opt.state.pop(p, None)


def _rng_state() -> torch.Tensor:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat([torch.tensor([len(states)], dtype=torch.uint8)] + [s.view(torch.uint8) for s in states])


def set_rng_state(packed: torch.Tensor) -> None:
    """Restore what ``_rng_state`` packed (the CPU generator, then CUDA's if it was saved)."""
    count = int(packed[0])
    cpu = torch.get_rng_state()
    torch.set_rng_state(packed[1:1 + cpu.numel()].clone())
    if count > 1 and torch.cuda.is_available():
        torch.cuda.set_rng_state(packed[1 + cpu.numel():].clone())


# -- save ---------------------------------------------------------------------------------------


def _record(program: Program, step: int, extra: dict | None, scheduler: Any = None) -> dict[str, Any]:
    """What the completion marker says besides the model's tensors and the digests."""
    try:
        extra = json.loads(json.dumps(dict(extra or {}), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint's extra must hold plain values (numbers, strings, lists, dicts): {e}",
                              hint="keep extra= to numbers, strings, lists and dicts") from e
    try:
        schedule = json.loads(json.dumps(fingerprint.scheduler_entry(scheduler)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the LR scheduler's state_dict must hold plain values to be saved: {e}",
                              hint="use a scheduler of torch.optim.lr_scheduler, or save it yourself in extra=") from e
    return {"step": step, "world_size": program.ctx.world_size, "mesh": str(program.plan.mesh), "extra": extra,
            "optimizer": fingerprint.optimizer_entry(program.optimizer),
            "scheduler": schedule,
            "order": [n for names in program.state_names.values() for n in names]}


def save(program: Program, path: Any, *, step: int, extra: dict | None = None, async_save: bool = False,
         on_complete: Callable[[Path], None] | None = None, buffers: dict | None = None,
         scheduler: Any = None) -> Pending | None:
    """``ParallelModel.save_checkpoint``: DCP over ``training_state``, the completion marker last
    (runtime/state/marker.py; ``step``: optimizer steps completed; ``scheduler``: the LR
    scheduler, whose state_dict the marker holds). With ``async_save`` a CPU copy
    is taken here (into ``buffers`` when given, kept for the next save) and written in the
    background, over a process group of its own (DCP's collectives must not interleave with
    training's): wait on the returned ``Pending``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    record = _record(program, step, extra, scheduler)
    state = training_state(program)
    if program.ctx.rank == 0:
        begin_save(path)  # marks the folder partita's; one saved over stops counting until this one completes
    what = f"the checkpoint save of {path}"
    if async_save:
        writer = Writer(path, record, on_complete=on_complete)
        with FLIGHT.waiting(what), named_errors(path, "write"):
            future = dcp.async_save(state, storage_writer=writer, async_stager=_CopyStager(buffers),
                                    process_group=_save_group())
        return Pending(future, path)
    writer = Writer(path, record, local=FLIGHT.alone, on_complete=on_complete)
    with FLIGHT.waiting(what), named_errors(path, "write"):
        dcp.save(state, storage_writer=writer)
    return None


class Pending:
    """An asynchronous save in flight: ``result()`` waits until its marker is written, and raises
    its failure as one ``CheckpointError`` naming the checkpoint."""

    def __init__(self, future: Any, path: Path) -> None:
        self.future, self.path = future, path

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> None:
        with named_errors(self.path, "write"):
            self.future.result(timeout)


_SAVE_GROUP: list[Any] = [None, None]  # (the default group it was made beside, the group for async saves)


def _save_group() -> Any:
    """A gloo group beside the default one for the background saves (made once: a collective)."""
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _SAVE_GROUP[0] is not default:
        try:
            timeout = default._get_backend(torch.device("cpu")).options._timeout
        except (RuntimeError, AttributeError):
            timeout = None
        _SAVE_GROUP[:] = [default, dist.new_group(backend="gloo", timeout=timeout)]
    return _SAVE_GROUP[1]


@contextlib.contextmanager
def named_errors(path: Path, doing: str) -> Iterator[None]:
    """Every failure of DCP's (its CheckpointException is a BaseException) as one CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # DCP warns that one process is one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointError:
        raise
    except (CheckpointException, Exception) as e:  # (anything DCP raises becomes one message)
        failures = getattr(e, "failures", None) or {0: (e, None)}
        inner = failures[min(failures)][0]
        if _lost_a_peer(inner):  # a peer vanished (a lost node, the watchdog): not this checkpoint's fault
            raise inner from None
        raise _as_error(e, path, doing) from None


def _as_error(e: BaseException, path: Path, doing: str) -> CheckpointError:
    failures = getattr(e, "failures", None)
    if failures:
        rank, (inner, _) = min(failures.items(), key=lambda kv: kv[0])
        if isinstance(inner, CheckpointError):
            return inner
        reason = f"{type(inner).__name__}: {inner}" + (f" (rank {rank})" if len(failures) < 2 else "")
    else:
        reason = f"{type(e).__name__}: {e}"
    hint = ("free space on that file system, or keep fewer checkpoints (keep_last=)" if doing == "write"
            else "load another checkpoint (with checkpoint_dir= the run falls back to the newest intact one)")
    return CheckpointError(f"cannot {doing} checkpoint {path}: {reason.strip()}", hint=hint)
