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
    meta                    completed steps, the optimizer's hyperparameters, the user's ``extra`` (JSON)

(``dcp_to_torch_save`` returns the nested dict ``{"model": {...}, "optim": ...}``.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.core.errors import PartitaError
from partita.core.placement import shard_dim
from partita.runtime.program import Program

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
        z = in_zero.get(id(param))
        opt = program.optimizer  # the one optimizer (ZeRO's, on its shards and any whole parameters)
        yield _Held(aliases.get(name, [name]), shape, tuple(origin), tuple(local_shape), param, opt, z)


class _Pieces(torch.Tensor):
    """The blocks of a whole tensor that this rank holds, as DCP saves and loads them.

    A data-less tensor of the WHOLE shape that implements DCP's checkpointable protocol (the one
    DTensor implements): one write item / chunk per block, each block's data looked up by its
    offsets. Unlike a ShardedTensor it lists only this rank's blocks, as its plan needs no other
    rank's; unlike a DTensor it can describe ZeRO's ranges of flat buckets."""

    @staticmethod
    def __new__(cls, pieces: list[Piece], shape: tuple[int, ...]) -> _Pieces:
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
    """``dcp.async_save``'s staging for ``_Pieces``: a CPU copy of every block, taken before
    ``save_checkpoint`` returns, so training may change the parameters while the copy is written."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state: Any) -> Any:
        def copy(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: copy(x) for k, x in v.items()}
            if isinstance(v, _Pieces):
                return _Pieces([(off, d.to("cpu", copy=True)) for off, d in v.pieces.items()], tuple(v.shape))
            if isinstance(v, torch.Tensor):
                return v.detach().to("cpu", copy=True)
            return v

        return copy(state)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _sharded(pieces: list[Piece], shape: tuple[int, ...]) -> torch.Tensor:
    """``pieces`` of a whole tensor of ``shape`` as DCP takes them: the tensor itself when it is
    whole (identical replicas are then written once), else a ``_Pieces``."""
    if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(shape):
        return pieces[0][1]
    return _Pieces(pieces, shape)


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


def training_state(program: Program) -> dict[str, Any]:
    """This rank's state dict for DCP (module docstring): views of what it holds, so ``dcp.load``
    writes straight into the parameters and the optimizer state."""
    for opt in _optimizers(program):
        _init_optimizer_state(opt)
    model_part: dict[str, Any] = {}
    optim_part: dict[str, Any] = {}
    updates = program.updates
    master = updates.master_of if updates is not None else (lambda t: t)  # fp32 masters under mixed precision
    for h in _tensors_of(program):
        shard = master(h.zero[0].shard) if h.zero is not None else None
        param = master(h.param)
        pieces = _pieces(h, shard, param)
        state = h.optimizer.state.get(shard if shard is not None else param, {}) if h.optimizer else {}
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
    rank = program.ctx.rank
    return {"model": model_part, "optim": optim_part, "rng": {str(rank): _rng_state()}}


def _optimizers(program: Program) -> list[torch.optim.Optimizer]:
    return [o for o in (program.optimizer,) if o is not None]


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (a step at lr 0 over zero gradients), so that a
    checkpoint can be loaded into them; an optimizer that has stepped is left alone."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state for p in params):
        return
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


_HYPER = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "maximize", "amsgrad")


def _meta(program: Program, step: int, extra: dict | None) -> dict[str, Any]:
    opt = _optimizers(program)
    groups = [{k: g[k] for k in _HYPER if k in g} for g in opt[0].param_groups] if opt else []
    return {"step": step, "param_groups": groups, "extra": dict(extra or {}),
            "fingerprint": program.plan.model.fingerprint}


def save(program: Program, path: Any, *, step: int, extra: dict | None = None, async_save: bool = False) -> Any:
    """``ParallelModel.save_checkpoint``: DCP over ``training_state`` plus the run's metadata
    (``step``: optimizer steps completed)."""
    import torch.distributed.checkpoint as dcp

    state = training_state(program)
    try:
        state["meta"] = json.dumps(_meta(program, step, extra))  # one leaf (a dict would be flattened), no pickle
    except TypeError as e:
        raise PartitaError(f"save_checkpoint's extra must hold plain values (numbers, strings, lists, dicts): {e}",
                           hint="keep extra= to numbers, strings, lists and dicts") from e
    if async_save:
        return dcp.async_save(state, checkpoint_id=str(path), async_stager=_CopyStager())
    dcp.save(state, checkpoint_id=str(path))
    return None


def load(program: Program, path: Any) -> tuple[int, dict]:
    """``ParallelModel.load_checkpoint``: every piece this rank holds read in place, then the
    hyperparameters and this rank's random state restored; returns the saved step count and
    the user's ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(str(path)).read_metadata()
    except (OSError, ValueError) as e:
        raise PartitaError(f"{path} is not a checkpoint: {e}",
                           hint="pass a directory written by save_checkpoint (or checkpoint_dir=)") from e
    keys = set(saved.state_dict_metadata)
    state = training_state(program)
    missing = sorted(f"model/{k}" for k in state["model"] if f"model.{k}" not in keys)
    if missing:
        raise PartitaError(f"checkpoint {path} lacks {len(missing)} tensor(s) of this model, e.g. "
                           f"{', '.join(missing[:3])}", hint="load a checkpoint of the same model")
    state["optim"] = {k: v for k, v in state["optim"].items() if f"optim.{k}" in keys}
    state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in keys}
    state["meta"] = ""
    dcp.load(state, checkpoint_id=str(path))
    meta = json.loads(state["meta"])
    for opt in _optimizers(program):
        for g, saved_g in zip(opt.param_groups, meta.get("param_groups", [])):
            g.update(saved_g)
    if program.updates is not None:
        program.updates.masters_to_params()  # mixed precision: the masters cast into the parameters
    if program.zero is not None:
        program.zero.shards_to_params()  # ZeRO-1/2: every rank's slice back into the full parameters
    for packed in state["rng"].values():
        set_rng_state(packed)
    return int(meta.get("step", 0)), dict(meta.get("extra", {}))


COMPLETE = "partita-complete.json"  # written last, by rank 0, once every rank's write has returned


def step_dir(root: Any, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def latest(root: Any) -> Path | None:
    """The newest complete checkpoint under ``root`` (a save a kill interrupted has no marker)."""
    root = Path(root)
    done = sorted(p for p in root.glob("step-*") if (p / COMPLETE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def save_periodic(program: Program, root: Any, *, step: int, extra: dict | None = None) -> Path:
    """Save under ``root/step-NNNNNNNN`` and mark it complete once every rank has written."""
    path = step_dir(root, step)
    save(program, path, step=step, extra=extra)
    if dist.is_initialized():
        dist.barrier()
    if program.ctx.rank == 0:
        tmp = path / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps({"step": step, "world_size": program.ctx.world_size}))
        tmp.rename(path / COMPLETE)  # atomic: a reader sees the marker whole or not at all
    return path
