"""Periodic checkpoints under one folder (``checkpoint_dir``): where each goes, which are kept,
and which one a restart resumes from.

Every ``checkpoint_every`` steps a checkpoint is written to ``step-NNNNNNNN`` (in the background
by default: runtime/state/sharded.py ``save``). Once its marker is written, the coordinator deletes
all but the newest ``keep_last`` complete checkpoints (``DEFAULT_KEEP_LAST``; 0 keeps every one)
and the saves older than the newest complete one that never completed. A restart resumes from the
newest complete checkpoint whose files match their digests; each newer one that does not is
skipped, with one line saying why (``resume_point``). Which checkpoints there are is the
coordinator's look (``survey``), handed to every rank, so all ranks resume from the same one.
"""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path
from typing import Any

from partita.runtime.program import Program
from partita.runtime.state.marker import COMPLETE, METADATA, STARTED, CheckpointError, read_marker, verify
from partita.runtime.state.sharded import Pending, save

DEFAULT_KEEP_LAST = 3  # enough that a damaged newest one leaves two to fall back to
_STEP = re.compile(r"step-(\d+)")


def step_dir(root: Any, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def _steps(root: Any) -> list[Path]:
    """The step folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP.fullmatch(p.name) and p.is_dir()),
                  key=lambda p: int(p.name[5:]))


def complete(root: Any) -> list[Path]:
    """The checkpoints under ``root`` that have their completion marker, oldest first."""
    return [p for p in _steps(root) if (p / COMPLETE).is_file()]


def latest(root: Any) -> Path | None:
    """The newest complete checkpoint under ``root`` (a save a kill interrupted has no marker)."""
    done = complete(root)
    return done[-1] if done else None


def prune(root: Any, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0: keep all) and the
    interrupted saves older than the newest complete one; returns the folders deleted.

    Only what partita wrote goes (``_remove_ours``): a ``step-N`` folder of the user's own, or a
    file the user put in a checkpoint, stays, with one line naming it."""
    steps = _steps(root)
    done = [p for p in steps if (p / COMPLETE).is_file()]
    if not done:
        return []
    newest = int(done[-1].name[5:])
    doomed = [p for p in steps if p not in done and int(p.name[5:]) < newest]
    if keep_last > 0:
        doomed += done[:-keep_last]
    return [p for p in doomed if _remove_ours(p)]


_DCP_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's data files (runtime/state/marker.py Writer names them so)


def _remove_ours(path: Path) -> bool:
    """Delete the files of partita's save at ``path`` (those its marker lists, the marker, DCP's
    metadata and data files of a save partita started), then the folder if nothing else is left;
    True when the folder is gone. A folder partita did not start (no marker, no ``STARTED``) loses
    nothing but is removed when empty."""
    ours = {COMPLETE, COMPLETE + ".tmp", STARTED, METADATA, METADATA + ".tmp"}
    started = _started(path)
    if (path / COMPLETE).is_file():
        with contextlib.suppress(CheckpointError):  # an unreadable marker: the names above still hold
            ours |= set(read_marker(path)["files"])
    left = []
    for f in path.iterdir():
        if started and f.is_file() and (f.name in ours or _DCP_FILE.fullmatch(f.name)):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        else:
            left.append(f.name)
    if left:
        print(f"partita: kept {path} while pruning old checkpoints: it holds what partita did not write "
              f"({', '.join(sorted(left)[:5])}{', ...' if len(left) > 5 else ''})", file=sys.stderr, flush=True)
        return False
    with contextlib.suppress(OSError):
        path.rmdir()
    return not path.exists()


def survey(root: Any) -> dict[str, Any]:
    """What the coordinator sees under ``root``: the complete checkpoints, newest last, each with its
    marker or why it has none that reads; and a line for each newer save of partita's without its
    marker. Plain values, so one rank's look can be handed to every rank (``resume_point``)."""
    done = complete(root)
    newest = int(done[-1].name[5:]) if done else -1
    # a save of partita's newer than the newest complete checkpoint, without its marker: interrupted, or
    # the marker removed; named (never silently passed over), but no reason to refuse a fresh start
    unfinished = [f"checkpoint {p} has no completion marker ({COMPLETE}): its save did not finish, or the "
                  "marker was removed" for p in reversed(_steps(root))
                  if int(p.name[5:]) > newest and _started(p)]
    checkpoints = []
    for path in done:
        try:
            checkpoints.append((str(path), read_marker(path), None))
        except CheckpointError as e:
            checkpoints.append((str(path), None, e.message))
    return {"complete": checkpoints, "unfinished": unfinished}


def resume_point(root: Any, seen: dict[str, Any] | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ``root`` whose every file matches its digest (a
    collective: the files are shared out over the ranks), and a line for each newer one skipped
    (damaged, or a save of partita's without its marker). ``seen``: the coordinator's ``survey`` of
    ``root``, the same on every rank (each rank looking for itself could pick another checkpoint
    while a save is under way); this rank's own look without one.
    None when there is no complete checkpoint; one ``CheckpointError`` when none is intact."""
    seen = survey(root) if seen is None else seen
    skipped: list[str] = []
    for path, marker, unreadable in reversed(seen["complete"]):
        try:
            if unreadable is not None:
                raise CheckpointError(unreadable)
            verify(Path(path), marker)
        except CheckpointError as e:
            skipped.append(e.message)
            continue
        return Path(path), seen["unfinished"] + skipped
    if skipped:
        raise CheckpointError(f"no intact checkpoint to resume from in {root}: {'; '.join(skipped)}",
                              hint="move the damaged checkpoints away to start afresh, or point checkpoint_dir "
                              "at another folder")
    return None, seen["unfinished"]


def _started(path: Path) -> bool:
    """Whether a save of partita's started in ``path``: its mark (``STARTED``), or its marker."""
    return (path / STARTED).is_file() or (path / COMPLETE).is_file()


def save_periodic(program: Program, root: Any, *, step: int, extra: dict | None = None, async_save: bool = True,
                  keep_last: int = DEFAULT_KEEP_LAST, buffers: dict | None = None,
                  scheduler: Any = None) -> Pending | None:
    """Save under ``root/step-NNNNNNNN`` (its marker written once every rank has written); then the
    coordinator prunes ``root`` to ``keep_last`` (``prune``). ``buffers``: the CPU copies of the
    previous asynchronous save, reused (the caller waited for it)."""
    return save(program, step_dir(root, step), step=step, extra=extra, async_save=async_save,
                on_complete=lambda _: prune(root, keep_last), buffers=buffers, scheduler=scheduler)
