"""A run's checkpoints, as ``ParallelModel`` keeps them: ``save`` and ``load`` by hand
(runtime/state/sharded.py, loading.py) and, with ``checkpoint_dir``, the periodic ones
(runtime/state/periodic.py): every ``checkpoint_every`` steps, written in the background unless
``async_checkpoints=False``, one in flight at a time and the last waited for at exit, the newest
``keep_last`` kept; a run that finds an intact one there resumes from it (``resume``). The
directory is the run's alone while it runs (runtime/state/lock.py).
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from partita.core.errors import PartitaError
from partita.core.options import Options
from partita.runtime.distributed import shared_from
from partita.runtime.program import Program
from partita.runtime.state import loading, lock, periodic, sharded


class Checkpoints:
    """This rank's side of the run's checkpoints (module docstring). The step count is the caller's:
    ``save`` is given it, ``load`` and ``resume`` return it."""

    def __init__(self, program: Program, options: Options) -> None:
        self.program = program
        self.root = options.checkpoint_dir
        self.every = options.checkpoint_every or 0
        self.keep_last = options.keep_last if options.keep_last is not None else periodic.DEFAULT_KEEP_LAST
        self.async_save = options.async_checkpoints is not False
        self.extra: dict = {}  # saved with every periodic checkpoint, restored on resume (e.g. the data position)
        self.resumed_from: Path | None = None
        self._pending: sharded.Pending | None = None  # the periodic save being written in the background
        self._staging: dict = {}  # its CPU copy, reused by the next one
        self._waits_at_exit = False

    def resume(self) -> int:
        """The newest intact checkpoint under ``checkpoint_dir`` loaded, if there is one (a collective);
        the step to go on from (0 without)."""
        if self.root is None:
            return 0
        found, damaged = periodic.resume_point(self.root, self._hold())
        if self.program.ctx.rank == 0:
            for message in damaged:
                print(f"partita: {message}: skipped it", flush=True)
        if found is None:
            return 0
        step, self.extra = self.load(found)
        self.resumed_from = found
        if self.program.ctx.rank == 0:
            print(f"partita: resumed from {found} (step {step})", flush=True)
        return step

    def _hold(self) -> dict:
        """Rank 0 takes ``checkpoint_dir``'s lock (runtime/state/lock.py) and looks at what is there;
        every rank gets its look, or its one message when another run holds the directory."""
        seen: Any = None
        if self.program.ctx.rank == 0:
            try:
                note = lock.DirectoryLock(self.root).acquire()
                if note:
                    print(note, file=sys.stderr, flush=True)
                seen = periodic.survey(self.root)
            except PartitaError as e:
                seen = {"refused": (e.message, e.hint)}
        seen = shared_from(seen)  # rank 0's look, or its refusal, on every rank
        if "refused" in seen:
            raise PartitaError(seen["refused"][0], hint=seen["refused"][1])
        return seen

    def save(self, path: str | Path, *, step: int, extra: dict | None = None, async_save: bool = False) -> Any:
        """``ParallelModel.save_checkpoint``: this run's state at ``step`` to ``path``."""
        return sharded.save(self.program, path, step=step, extra=extra, async_save=async_save,
                            scheduler=self.program.scheduler)

    def load(self, path: str | Path, *, optimizer: str = "restore", partial: bool = False) -> tuple[int, dict]:
        """``ParallelModel.load_checkpoint``: the state in ``path`` restored in place; its step and ``extra``."""
        return loading.load(self.program, path, optimizer=optimizer, partial=partial, scheduler=self.program.scheduler)

    def save_if_due(self, step: int) -> None:
        """After step ``step``: a periodic checkpoint, if one is due (the previous one waited for first)."""
        if self.root is None or not self.every or step % self.every:
            return
        self.wait()  # one save in flight at a time
        if self.async_save and not self._waits_at_exit:  # the last one completes before the process ends
            atexit.register(_wait_at_exit, weakref.ref(self))
            self._waits_at_exit = True
        self._pending = periodic.save_periodic(self.program, self.root, step=step, extra=self.extra,
                                               async_save=self.async_save, keep_last=self.keep_last,
                                               buffers=self._staging, scheduler=self.program.scheduler)

    def wait(self) -> None:
        """``ParallelModel.wait_for_checkpoint``: the periodic save in flight, complete."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()


def _wait_at_exit(ref: weakref.ref) -> None:
    """At exit: the periodic checkpoint still being written completes, or its failure is said in one
    line (never an atexit traceback); a save cut short because a peer went away says nothing, since
    the launcher names the node it lost (runtime/processes/agent.py)."""
    from partita.runtime.distributed import _leave_traceback, _lost_a_peer

    checkpoints = ref()
    try:
        if checkpoints is not None:
            checkpoints.wait()
    except PartitaError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(e.exit_code)
    except BaseException as e:  # (what a collective raised mid-save: gloo's, NCCL's, DCP's)
        rank = checkpoints.program.ctx.rank if checkpoints is not None else 0
        quiet = _lost_a_peer(e) and _leave_traceback(rank, type(e), e, e.__traceback__)
        if not quiet:
            print(f"error: the checkpoint being written as the run ended failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        os._exit(1)
