"""Loading a checkpoint: everything checked before anything changes.

``load`` reads the completion marker, checks every file's digest and the fingerprint
(runtime/state/marker.py, runtime/state/fingerprint.py), then has DCP read every piece this rank
holds into a CPU copy of its state (runtime/state/sharded.py ``training_state``: the same
pieces, in the whole tensors' coordinates, so any plan loads any checkpoint); only when all of
that succeeded is the copy copied in. A failed load leaves the model and the optimizer as they
were, and is one ``CheckpointError`` naming the checkpoint and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partita.core.errors import PartitaError
from partita.runtime.processes.watchdog import FLIGHT
from partita.runtime.program import Program
from partita.runtime.state import fingerprint
from partita.runtime.state.marker import CheckpointError, Planner, Reader, read_marker, verify
from partita.runtime.state.sharded import (
    Pieces,
    drop_state,
    init_optimizer_state,
    named_errors,
    set_rng_state,
    training_state,
)


def load(program: Program, path: Any, *, optimizer: str = "restore", partial: bool = False,
         scheduler: Any = None) -> tuple[int, dict]:
    """``ParallelModel.load_checkpoint``: the marker and every file's digest checked, the fingerprint
    compared (runtime/state/fingerprint.py), every piece this rank holds read into a copy; only
    when all of that succeeded is it copied in, with the hyperparameters and the LR ``scheduler``'s
    state (both with ``optimizer="restore"``) and this rank's random state. Returns the saved
    step count and the user's ``extra``."""
    if optimizer not in fingerprint.OPTIMIZER_MODES:
        raise PartitaError(f"optimizer={optimizer!r} is not one of {', '.join(fingerprint.OPTIMIZER_MODES)}",
                           hint="restore: the same optimizer and hyperparameters; state: the same optimizer, this "
                           "run's hyperparameters; skip: the model only")
    path = Path(path)
    with FLIGHT.waiting(f"the checkpoint load of {path}"):
        marker = read_marker(path)
        verify(path, marker)
        _check_fingerprint(program, path, marker, optimizer, partial, scheduler)
        reader = Reader(path)
        with named_errors(path, "read"):
            metadata = reader.read_metadata()
        opt = program.optimizer if optimizer != "skip" else None
        fresh = init_optimizer_state(opt) if opt is not None else []
        try:
            state = _wanted(training_state(program, optimizer=opt is not None), metadata, path)
            staged = _empty_like(state)
            with named_errors(path, "read"):
                import torch.distributed.checkpoint as dcp

                dcp.load(staged, storage_reader=reader, planner=Planner())
        except BaseException:
            if opt is not None:
                drop_state(opt, fresh)  # as it was: a failed load changes nothing
            raise
    _copy_into(state, staged)
    if optimizer == "restore" and opt is not None:
        for g, saved_g in zip(opt.param_groups, (marker.get("optimizer") or {}).get("param_groups", [])):
            g.update({k: tuple(v) if k == "betas" else v for k, v in saved_g.items()})
        if scheduler is not None and marker.get("scheduler") is not None:
            scheduler.load_state_dict(marker["scheduler"]["state"])  # the schedule goes on where it was
    if program.updates is not None:
        program.updates.masters_to_params()  # mixed precision: the masters cast into the parameters
    if program.zero is not None:
        program.zero.shards_to_params()  # ZeRO-1/2: every rank's slice back into the full parameters
    for packed in staged["rng"].values():
        set_rng_state(packed)
    return int(marker.get("step", 0)), dict(marker.get("extra", {}))


def _check_fingerprint(program: Program, path: Path, marker: dict, optimizer: str, partial: bool,
                       scheduler: Any = None) -> None:
    """Refuse a checkpoint of another model or optimizer (the same verdict on every rank)."""
    mine = fingerprint.model_entries(training_state(program, optimizer=False)["model"])
    parts: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    here = fingerprint.merged(parts, [n for names in program.state_names.values() for n in names])
    diff = (fingerprint.model_difference(marker.get("model", {}), here, partial=partial)
            or fingerprint.optimizer_difference(marker.get("optimizer"),
                                                fingerprint.optimizer_entry(program.optimizer), optimizer)
            or fingerprint.scheduler_difference(marker.get("scheduler"), scheduler, optimizer))
    if diff is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {diff.message}", hint=diff.hint)


def _wanted(state: dict[str, Any], metadata: Any, path: Path) -> dict[str, Any]:
    """The entries of ``state`` the checkpoint holds, each a tensor there (never a pickled object)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held = metadata.state_dict_metadata
    out: dict[str, dict[str, Any]] = {}
    for part, entries in state.items():
        out[part] = {}
        for name, value in entries.items():
            md = held.get(f"{part}.{name}")
            if md is None:
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"refusing checkpoint {path}: its {part}.{name} is a pickled object, not a "
                                      "tensor", hint="load only checkpoints partita wrote")
            if part == "rng" and tuple(md.size) != tuple(value.shape):
                continue  # another device's generators: this rank keeps its own
            out[part][name] = value
    return out


def _empty_like(state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of ``state``'s layout, for DCP to read into before anything is changed."""
    def empty(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: empty(x) for k, x in v.items()}
        if isinstance(v, Pieces):
            return Pieces([(off, torch.empty(d.shape, dtype=d.dtype)) for off, d in v.pieces.items()], tuple(v.shape))
        return torch.empty(v.shape, dtype=v.dtype)

    return empty(state)


@torch.no_grad()
def _copy_into(state: dict[str, Any], staged: dict[str, Any]) -> None:
    for key, value in state.items():
        got = staged[key]
        if isinstance(value, dict):
            _copy_into(value, got)
        elif isinstance(value, Pieces):
            for off, data in value.pieces.items():
                data.copy_(got.pieces[off])
        else:
            value.copy_(got)

