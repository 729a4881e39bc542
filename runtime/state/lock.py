"""A checkpoint directory belongs to one run at a time.

Two runs writing one ``checkpoint_dir`` would each prune and overwrite the other's saves, and
each rank would pick its own resume point while the other run writes. So the run's rank 0 holds
``partita-run.lock`` in the directory from the model's build to its exit (``hold``): which run
(``run_identity``), its host and process, when it started, and a heartbeat it rewrites every
``BEAT_S``. A second run finds the lock held and is refused with one message naming that run's
host and process. A lock is another run's only while it is alive: on this host its process
still runs; on another host its heartbeat is younger than ``STALE_S``. A restart or an elastic
re-plan of the same run (the same identity) takes the lock over, and a lock left by a run that
died is taken over with one line saying so.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from partita.core.errors import PartitaError

LOCK = "partita-run.lock"
BEAT_S = 10.0
STALE_S = 60.0  # a lock on another host whose heartbeat is older than this is a dead run's
RUN_ENV = "PARTITA_RUN_ID"  # set by `partita run` for its workers (runtime/processes/launch.py)


def run_identity(environ: Any = os.environ) -> str:
    """What makes this run one run across its ranks and restarts: `partita run`'s id, else
    torchrun's (run id and rendezvous address), else this process."""
    if environ.get(RUN_ENV):
        return environ[RUN_ENV]
    if environ.get("TORCHELASTIC_RUN_ID") and environ.get("MASTER_PORT"):
        return (f"torchrun:{environ['TORCHELASTIC_RUN_ID']}@{environ.get('MASTER_ADDR', socket.gethostname())}:"
                f"{environ['MASTER_PORT']}")
    return f"process:{socket.gethostname()}:{os.getpid()}"


def _alive(entry: dict[str, Any]) -> bool:
    """Whether the run that wrote ``entry`` still runs (module docstring)."""
    if entry.get("host") == socket.gethostname() and isinstance(entry.get("pid"), int):
        try:
            os.kill(entry["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True
    beat = entry.get("beat")
    return isinstance(beat, (int, float)) and time.time() - beat < STALE_S


def _read(path: Path) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: not a live run's (its writer rewrites it whole)
    return entry if isinstance(entry, dict) else {}


def _describe(entry: dict[str, Any]) -> str:
    since = entry.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {entry.get('host', '?')}, process {entry.get('pid', '?')}, since {when}"


class DirectoryLock:
    """This run's hold on ``root`` (module docstring): ``acquire`` refuses a directory another live
    run holds; the heartbeat runs until ``release`` (at exit)."""

    def __init__(self, root: str | Path, identity: str | None = None) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK
        self.identity = identity or run_identity()
        self.entry = {"run": self.identity, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock; one line to print when a dead run's lock was taken over (else None).
        Raises one ``PartitaError`` when another live run holds it."""
        self.root.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):
            held = _read(self.path)
            if held is None:
                try:  # created only if absent: two runs starting at once cannot both win
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    continue
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(self._beat()))
                break
            if held.get("run") != self.identity and held and _alive(held):
                raise PartitaError(
                    f"checkpoint directory {self.root} is in use by another run ({_describe(held)}): two runs "
                    "writing one directory would prune and overwrite each other's checkpoints",
                    hint="give this run a checkpoint directory of its own, or wait for that run to end; if it is "
                    f"no longer running, delete {self.path}")
            if held.get("run") != self.identity:
                note = (f"partita: took over {self.path} from a run that is no longer running "
                        f"({_describe(held) if held else 'an unreadable lock'})")
            self._write()
            break
        else:
            raise PartitaError(f"could not take the lock {self.path}: other runs keep creating it",
                               hint="give this run a checkpoint directory of its own")
        self._thread = threading.Thread(target=self._run, name="partita-checkpoint-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)
        return note

    def _beat(self) -> dict[str, Any]:
        return {**self.entry, "beat": time.time()}

    def _write(self) -> None:
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._beat()))
        os.replace(tmp, self.path)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            held = _read(self.path)
            if held is None or held.get("run") != self.identity or held.get("pid") != os.getpid():
                return  # released, or taken over by this run's next attempt
            try:
                self._write()
            except OSError:
                return

    def release(self) -> None:
        """Give the lock up, if it is still this process's."""
        self._stop.set()
        held = _read(self.path)
        if held and held.get("run") == self.identity and held.get("pid") == os.getpid():
            try:
                self.path.unlink()
            except OSError as e:
                print(f"partita: could not remove {self.path}: {e.strerror or e}", file=sys.stderr, flush=True)
