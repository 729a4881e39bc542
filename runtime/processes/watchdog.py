"""No wait is unbounded: a flight recorder of the collectives each rank entered, and a watchdog.

``FLIGHT`` (one per process) keeps the last ``FlightRecorder.KEEP`` collectives
and point-to-point waits this rank entered (kind, mesh axis, group, bytes, step,
micro-batch), fed by ``CollectiveCounter.record`` (runtime/collectives.py) and
by every blocking receive; ``TraceRecorder.span`` (runtime/trace.py) marks each
micro-batch's forward and backward. Each of these is progress.

``Watchdog`` (one daemon thread per process, started by ``ParallelModel``)
looks every few seconds: when a step has made no progress for longer than the
limit (``PARTITA_WATCHDOG_S``, ``watchdog_s=`` on the decorator or
``ParallelModel``, ``partita run --watchdog``; default ``DEFAULT_TIMEOUT_S``,
0 turns it off), the rank is waiting in a collective its peers do not reach.
It raises the alarm in the rendezvous store (the c10d TCPStore every rank
already reaches, so this works across nodes while the process groups are
blocked); every rank's watchdog, seeing it, posts what it is waiting in and its
last collectives. Rank 0 collects the reports (waiting ``GRACE_S`` at most for
ranks that do not answer), prints one message that names the ranks, what each
waits in and the groups whose members wait in different collectives, and every
rank exits with ``EXIT_HUNG``, so torchrun (and ``--max-restarts``) sees a
failed job instead of a hang. The process-group timeout is set above the limit
(runtime/distributed.py), so gloo's or NCCL's own timeout never fires first.

Progress is per micro-batch, so the limit also bounds one micro-batch's forward
or backward that runs no collective: keep it well above that. A checkpoint's save
and load are watched as a step is (``FLIGHT.waiting``), except the writing of a
rank's own files (``FLIGHT.alone``): the limit bounds how long a rank waits there
for its peers. An asynchronous save writes in the background; a rank that stops
then is found by the next step's collectives.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

from partita.core.mesh import Mesh

DEFAULT_TIMEOUT_S = 300.0
ENV = "PARTITA_WATCHDOG_S"
EXIT_HUNG = 3  # a rank hung: not a user error (2), and torchrun restarts on any non-zero exit
EXIT_NODE_LOST = 4  # `partita run`: another node's launcher or host went away, or this rank's launcher did
LAUNCHER_ENV = "PARTITA_LAUNCHER_PID"  # set by `partita run` for its workers: the process they must not outlive
GRACE_S = 30.0  # how long rank 0 waits for every rank's report once the alarm is up


def timeout_from_env(default: float = DEFAULT_TIMEOUT_S) -> float:
    """The limit the user set in ``PARTITA_WATCHDOG_S`` (seconds; 0: off), else ``default``; the
    variable is read and checked as the ``watchdog_s`` keyword is (core/options.py)."""
    from partita.core.options import environment_option

    value = environment_option("watchdog_s")
    return default if value is None else float(value)


@dataclass(frozen=True)
class Entry:
    """One collective (or blocking receive) this rank entered."""

    seq: int
    kind: str
    axis: str
    nbytes: int
    ranks: tuple[int, ...] | None  # the group, when not the rank's whole mesh axis
    step: int
    micro_batch: int | None
    phase: str  # "forward" | "backward" | "" (outside a micro-batch)
    t: float

    def what(self, mesh: Mesh | None, rank: int) -> str:
        group = self._group(mesh, rank)
        where = (f" over {self.axis}" if self.axis else "") + (f" ranks {list(group)}" if group else "")
        size = f" ({self.nbytes:,} B)" if self.nbytes else ""
        mb = f", micro-batch {self.micro_batch} {self.phase}" if self.micro_batch is not None else ""
        return f"{self.kind}{where}{size}, step {self.step}{mb}"

    def key(self, mesh: Mesh | None, rank: int) -> tuple:
        """What must agree between the members of a group waiting in the same collective."""
        return (self.kind, self.axis, tuple(self._group(mesh, rank) or ()), self.nbytes)

    def _group(self, mesh: Mesh | None, rank: int) -> tuple[int, ...] | None:
        return self.ranks or (mesh.group_ranks(rank, self.axis) if mesh is not None and self.axis else None)


class FlightRecorder:
    """The last collectives this process entered, and when it last made progress."""

    KEEP = 16

    def __init__(self) -> None:
        self.recent: collections.deque[Entry] = collections.deque(maxlen=self.KEEP)
        self.seq = 0
        self.step = 0
        self.micro_batch: int | None = None
        self.phase = ""
        self.progress = time.monotonic()
        self.busy = 0  # > 0 while a step (or an inference) runs
        self.mesh: Mesh | None = None
        self.rank = 0

    def entered(self, kind: str, axis: str, nbytes: int, ranks: tuple[int, ...] | None = None) -> None:
        self.seq += 1
        self.progress = time.monotonic()
        self.recent.append(Entry(self.seq, kind, axis, int(nbytes), ranks, self.step, self.micro_batch,
                                 self.phase, self.progress))

    def at(self, step: int, phase: str, micro_batch: int | None) -> None:
        """A micro-batch's forward or backward begins (progress)."""
        self.step, self.phase, self.micro_batch = step, phase, micro_batch
        self.progress = time.monotonic()

    def running(self) -> _Busy:
        """``with FLIGHT.running():`` around a step: the watchdog watches only inside."""
        return _Busy(self)

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """A collective wait outside a step (a checkpoint's save or load, every rank taking part),
        watched as a step is: ``what`` names it in the report."""
        self.micro_batch, self.phase = None, ""  # outside any micro-batch
        self.entered(what, "", 0)
        with self.running():
            yield

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Inside ``waiting``: work this rank does alone (writing its checkpoint files), which no
        peer holds up, so the watchdog does not count it as waiting."""
        busy, self.busy = self.busy, 0
        try:
            yield
        finally:
            self.busy = busy
            self.progress = time.monotonic()

    def report(self) -> dict[str, Any]:
        now = time.monotonic()
        last = self.recent[-1] if self.recent else None
        return {
            "rank": self.rank, "step": self.step, "busy": self.busy > 0, "idle_s": now - self.progress,
            "waiting": last.what(self.mesh, self.rank) if last is not None and self.busy else None,
            "key": list(last.key(self.mesh, self.rank)) if last is not None and self.busy else None,
            "group": list(last.key(self.mesh, self.rank)[2]) if last is not None else [],
            "recent": [e.what(self.mesh, self.rank) for e in list(self.recent)[-4:]],
            "coords": self.mesh.coords(self.rank) if self.mesh is not None else {},
        }


class _Busy:
    def __init__(self, flight: FlightRecorder) -> None:
        self.flight = flight

    def __enter__(self) -> None:
        self.flight.busy += 1
        self.flight.progress = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.flight.busy -= 1
        self.flight.progress = time.monotonic()


FLIGHT = FlightRecorder()


def _store(timeout_s: float) -> Any:
    """A client of the rendezvous store of its own (so a blocked main thread never holds its lock)."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, OSError):
            pass
    return dist.distributed_c10d._get_default_store()


class Watchdog:
    """This process's watchdog thread (module docstring)."""

    def __init__(self, flight: FlightRecorder, *, rank: int, world_size: int, timeout_s: float,
                 store: Any = None, out: TextIO | None = None, exit: Callable[[int], None] = os._exit,
                 grace_s: float = GRACE_S) -> None:
        self.flight, self.rank, self.world_size = flight, rank, world_size
        self.timeout_s, self.grace_s = timeout_s, min(grace_s, max(timeout_s, 5.0))
        self.poll_s = max(0.2, min(5.0, timeout_s / 5))
        self._store, self.out, self._exit = store, out, exit
        self.prefix = f"partita/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = _store(max(30.0, self.grace_s))
        return self._store

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="partita-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _alarm_up(self) -> bool:
        return self.store.check([self._key("alarm")])

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                stuck = self.flight.busy > 0 and time.monotonic() - self.flight.progress > self.timeout_s
                if stuck:
                    self.store.set(self._key("alarm"), str(self.rank))
                if stuck or self._alarm_up():
                    self._respond()
                    return
        except Exception as e:  # the store went away (the job is ending): nothing left to watch
            if not self._stop.is_set():
                print(f"partita watchdog on rank {self.rank} stopped: {e}", file=sys.stderr)

    def _respond(self) -> None:
        self.store.set(self._key(f"rank{self.rank}"), json.dumps(self.flight.report()))
        if self.rank == 0:
            message = self.verdict(self._collect())
            print(message, file=self.out or sys.stderr, flush=True)
            self._silence()
            self.store.set(self._key("verdict"), "1")
            time.sleep(min(1.0, self.grace_s))  # the others see it and go first
        else:
            self._silence()
            deadline = time.monotonic() + 2 * self.grace_s
            while time.monotonic() < deadline and not self.store.check([self._key("verdict")]):
                time.sleep(0.2)
            if not self.store.check([self._key("verdict")]):  # rank 0 is gone: say what this rank knows
                print(self.verdict({self.rank: self.flight.report()}), file=self.out or sys.stderr, flush=True)
        self._exit(EXIT_HUNG)

    def _silence(self) -> None:
        """From here this process only exits: the errors its blocked collectives raise as peers go
        (connection closed) would bury the report under one traceback per rank."""
        if self.out is None:
            sys.stderr.flush()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)

    def _collect(self) -> dict[int, dict[str, Any]]:
        keys = {r: self._key(f"rank{r}") for r in range(self.world_size)}
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(0.2)
        out = {}
        for r, k in keys.items():
            if self.store.check([k]):
                out[r] = json.loads(self.store.get(k))
        return out

    def verdict(self, reports: dict[int, dict[str, Any]]) -> str:
        """One message: which ranks wait in what, which groups disagree, which ranks never answered."""
        lines = [f"partita: the run hung: no progress for {self.timeout_s:g} s (the watchdog's limit; set it "
                 f"with {ENV} or `partita run --watchdog SECONDS`)"]
        by_wait: dict[str | None, list[int]] = {}
        for r, rep in sorted(reports.items()):
            by_wait.setdefault(rep["waiting"], []).append(r)
        for waiting, ranks in by_wait.items():
            coords = reports[ranks[0]].get("coords") or {}
            stage = f" (pipeline stage {coords['pp']})" if "pp" in coords and len(
                {reports[r]["coords"].get("pp") for r in ranks}) == 1 else ""
            lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}{stage}: "
                         + (f"waiting in {waiting}" if waiting else "not in a step (outside train_step)"))
        mismatched = []
        for r, rep in sorted(reports.items()):
            if not rep.get("key"):
                continue
            for m in rep["key"][2]:
                other = reports.get(m)
                if m > r and other is not None and other.get("key") and other["key"] != rep["key"]:
                    mismatched.append(f"rank {r} waits in {rep['waiting']}, but its peer rank {m} waits in "
                                      f"{other['waiting']}")
        if mismatched:
            lines.append("  mismatched collectives (the ranks of one group disagree on the next call):")
            lines += [f"    {m}" for m in mismatched]
        missing = sorted(set(range(self.world_size)) - set(reports))
        if missing:
            lines.append(f"  rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} did not answer "
                         f"(dead, or stuck outside partita's collectives)")
        for r, rep in sorted(reports.items()):
            if rep.get("recent"):
                lines.append(f"  rank {r}'s last collectives: " + "; ".join(rep["recent"]))
        lines.append("hint: a mismatch is a bug in partita or a rank running other code than its peers; "
                     "report it with this message. Every rank exits with code "
                     f"{EXIT_HUNG}, so `torchrun --max-restarts` can restart the job.")
        return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


_WATCHDOG: Watchdog | None = None


def watch(*, rank: int, world_size: int, mesh: Mesh, timeout_s: float | None = None) -> Watchdog | None:
    """Start this process's watchdog (once; a later call may lower its limit). None when off or alone.
    Under `partita run` the process is also tied to its launcher: it never outlives it."""
    global _WATCHDOG
    die_with_launcher()
    FLIGHT.mesh, FLIGHT.rank = mesh, rank
    limit = timeout_from_env() if timeout_s is None else timeout_s
    if world_size <= 1 or limit <= 0:
        return None
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(FLIGHT, rank=rank, world_size=world_size, timeout_s=limit)
        _WATCHDOG.start()
    elif limit < _WATCHDOG.timeout_s:
        _WATCHDOG.timeout_s = limit
    return _WATCHDOG


def die_with_launcher() -> None:
    """In a worker of `partita run`: be killed when the launcher dies (a SIGKILL of it included),
    and end at once if it is gone already, so that no rank trains on as an orphan (Linux's
    PR_SET_PDEATHSIG; elsewhere the peers' collectives and the watchdog end it). A SIGINT ends
    the worker quietly (the launcher says it once)."""
    pid = os.environ.get(LAUNCHER_ENV)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):
        os._exit(EXIT_NODE_LOST)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        # Ctrl-C reaches every process of the terminal's group: the launcher says it once
        signal.signal(signal.SIGINT, lambda *_: os._exit(128 + int(signal.SIGINT)))


def stop() -> None:
    """Stop this process's watchdog (the process group is going away)."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        _WATCHDOG.stop()
        _WATCHDOG = None


