"""Process group and device mesh for one rank.

``init_distributed`` is the only place the runtime starts torch.distributed.
Under torchrun (``WORLD_SIZE``/``RANK`` in the environment) it joins the
default process group; outside it, it returns a single-process context and
starts nothing, so a script written for partita also runs as a plain script.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partita.core.errors import PartitaError, printable
from partita.core.mesh import Mesh, MeshAxis
from partita.runtime.processes.watchdog import FLIGHT, timeout_from_env
from partita.runtime.processes.watchdog import stop as stop_watchdog


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: its rank, the world, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "nccl" | "gloo" | "none" (single process)
    device: torch.device
    initialized_here: bool  # True when init_distributed started the process group

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _backend() -> str:
    # Chosen from the build, never hard-coded: the CPU build has no NCCL, and the
    # combined "cpu:gloo,cuda:nccl" string fails there.
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(timeout_s: float | None = None, *, watchdog_s: float | None = None) -> DistContext:
    """Join (or reuse) the default process group; a single-process context outside torchrun.

    ``timeout_s`` bounds every collective: a rank that issues a collective its
    peers never match fails after this long instead of torch's default 30 minutes.
    By default it is the watchdog's limit (``watchdog_s``, else ``PARTITA_WATCHDOG_S``,
    runtime/processes/watchdog.py) plus a minute, so the watchdog, which names the stuck
    collective on every rank, always speaks first; 2 minutes with the watchdog off.
    """
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if under_torchrun and not (dist.is_available() and dist.is_initialized()):
        _one_line_before_the_group(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")))
    if timeout_s is None:
        limit = timeout_from_env() if watchdog_s is None else watchdog_s
        timeout_s = limit + 60 if limit > 0 else 120
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        device = _device(local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(rank, world, local_rank, str(dist.get_backend()), device, False)
    if not under_torchrun:
        _one_message_in_one_process()
        return DistContext(0, 1, 0, "none", _device(0), False)
    backend = _backend()
    device = _device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _leave_word(int(os.environ["RANK"]), "joining")  # a peer that ends before this is an early exit
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # A user's script seldom tears the group down; collectives still in flight at interpreter
    # exit (ZeRO-3's parameter gathers) then abort the process. Tear it down at exit instead.
    atexit.register(_destroy_at_exit)
    _one_message_for_user_errors(dist.get_rank())  # after init_process_group, which wraps the hook it finds
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device, True)


def _one_line_before_the_group(rank: int, local_rank: int) -> None:
    """A ``PartitaError`` raised before the process group exists (an option refused while it is set
    up, the same on every rank of a node) is said once per node, by local rank 0 (or, under
    ``partita run``, left in the run's error folder), and ends the rank with exit code 2."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, PartitaError):
            previous(kind, value, tb)
            return
        if local_rank == 0 or os.environ.get("PARTITA_ERROR_DIR"):
            _say(rank, value)
        os._exit(value.exit_code)

    sys.excepthook = hook


def _one_message_in_one_process() -> None:
    """A ``PartitaError`` a script did not catch, in a plain one-process run, is its one message
    (``error:`` and the hint) and exit code 2, not a traceback; anything else keeps its traceback."""
    previous = sys.excepthook
    if getattr(previous, "partita", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, PartitaError):
            previous(kind, value, tb)
            return
        print(_one_message(value), file=sys.stderr, flush=True)
        sys.exit(value.exit_code)

    hook.partita = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _one_message_for_user_errors(rank: int) -> None:
    """One message per failure, from the rank that failed, and no collateral tracebacks.

    A ``PartitaError`` no code caught ends this rank with exit code 2 and no traceback: under
    ``partita run`` its message goes to the run's error folder, and the launcher prints each
    distinct message once (runtime/processes/launch.py); under a plain torchrun this rank prints it as one
    ``error (rank R):`` line and a hint (a message several ranks raise alike is printed once).
    Every rank also leaves in the rendezvous store why it ended (``_ENDED``: an error, another
    failure, or its script ended); a rank whose collective then fails because a peer is gone
    says nothing more when that peer's own message says it, or one line naming the peer whose
    script ended while this one was still in a step. Anything else keeps its traceback."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, PartitaError):
            _post_end(rank, "error")
            _say(rank, value)
            os._exit(value.exit_code)  # without atexit's teardown: peers may be gone already
        gone = _peer_gone(rank) if _lost_a_peer(value) else None
        if gone is None:
            _post_end(rank, "failed")  # its traceback says why; peers stay quiet
            if _leave_traceback(rank, kind, value, tb):
                return  # `partita run` prints it once (or names the node it lost, when a peer vanished)
            previous(kind, value, tb)
            return
        peer, why = gone
        if why == "exited":  # the one rank that can say it: the peer ended without an error
            _say(rank, PartitaError(f"rank {peer}'s script ended while rank {rank} was still {_waiting(rank)}",
                                    hint="every rank must run the same steps (the same number of train_step calls "
                                    "over data of the same length)"))
        os._exit(1 if why == "failed" else 2)

    sys.excepthook = hook
    atexit.register(_post_end, rank, "exited")  # runs before _destroy_at_exit (registered earlier)


_ENDED = "partita/ended/"  # + restart count / rank -> "error" | "failed" | "exited"


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _ended_key(name: int | str) -> str:
    return f"{_ENDED}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def _post_end(rank: int, why: str) -> None:
    """Leave in the store why this rank ends (the first reason only)."""
    store = _store()
    try:
        if store is not None and not store.check([_ended_key(rank)]):
            store.set(_ended_key(rank), why)
    except Exception:  # the store is gone with the job: nobody is left to read it
        pass


def _peer_gone(rank: int, wait_s: float = 2.0) -> tuple[int, str] | None:
    """The first other rank that left word of ending, and why (waiting ``wait_s`` for one)."""
    store = _store()
    if store is None or not dist.is_initialized():
        return None
    others = [r for r in range(dist.get_world_size()) if r != rank]
    deadline = time.monotonic() + wait_s
    try:
        while True:
            for r in others:
                if store.check([_ended_key(r)]):
                    return r, store.get(_ended_key(r)).decode()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)
    except Exception:
        return None


def _say(rank: int, e: PartitaError) -> None:
    """The message of ``e``: to the run's error folder under ``partita run`` (its launcher prints
    each distinct message once), else on stderr as one line and its hint, by the first rank to say it."""
    folder = os.environ.get("PARTITA_ERROR_DIR")
    if folder and Path(folder).is_dir():
        Path(folder, f"rank{rank}.txt").write_text(str(e))
    elif _first_to_say(str(e)):
        print(_one_message(e, f" (rank {rank})"), file=sys.stderr, flush=True)
    if not folder and os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # under a plain torchrun, whose own report follows: it gives this message, not a link to its docs
        with contextlib.suppress(OSError):
            Path(os.environ["TORCHELASTIC_ERROR_FILE"]).write_text(
                json.dumps({"message": f"partita: {e}", "timestamp": int(time.time())}))
    sys.stdout.flush()


def _one_message(e: PartitaError, who: str = "") -> str:
    """A user error as a rank prints it: ``error<who>:`` and its message, its hint on the next line."""
    return f"error{who}: {printable(e.message)}" + (f"\n  hint: {printable(e.hint)}" if e.hint else "")


def shared_from(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` (a small picklable object) on every rank: a broadcast where a process
    group of more than one is up, ``value`` itself otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _leave_traceback(rank: int, kind: type[BaseException], value: BaseException, tb: Any) -> bool:
    """Under ``partita run``: this rank's traceback into the run's error folder instead of stderr
    (runtime/processes/agent.py ``failure_report`` prints it, the root cause's, unless a lost node
    explains it)."""
    import traceback

    return _leave_word(rank, "traceback", "".join(traceback.format_exception(kind, value, tb)))


def _leave_word(rank: int, kind: str, text: str = "") -> bool:
    """``rank<R>.<kind>`` in the run's error folder under ``partita run`` (its launcher reads them:
    runtime/processes/agent.py); whether there is such a folder."""
    folder = os.environ.get("PARTITA_ERROR_DIR")
    if not (folder and Path(folder).is_dir()):
        return False
    try:
        Path(folder, f"rank{rank}.{kind}").write_text(text)
    except OSError:  # the launcher is gone with its folder: nobody is left to read it
        return False
    return True


def _first_to_say(message: str) -> bool:
    """Whether this rank is the first to print ``message`` (several ranks raising one error print it once)."""
    store = _store()
    try:
        key = _ended_key("said/" + hashlib.sha256(message.encode()).hexdigest()[:16])
        return store is None or store.add(key, 1) == 1
    except Exception:
        return True


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo", "NCCL")


def _lost_a_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because a peer process went away."""
    return isinstance(e, getattr(dist, "DistError", ())) or (
        isinstance(e, RuntimeError) and any(w in str(e) for w in _PEER_LOST))


def _waiting(rank: int) -> str:
    """What this rank was waiting in when its peer went: the last collective it entered
    (runtime/processes/watchdog.py)."""
    last = FLIGHT.recent[-1] if FLIGHT.recent else None
    return f"in {last.what(FLIGHT.mesh, rank)}" if last is not None else "in a collective"


def _destroy_at_exit() -> None:
    stop_watchdog()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class _Groups:
    """The meshes and process groups this process has made, reused by every later program.

    A gloo group keeps its threads for the life of the process (destroying it does not end them
    all), so a process that builds many programs (a re-plan, an evaluation copy, a test running
    dozens of plans) would otherwise grow by every group each one makes: 6 threads per tp=2
    program, 256 after 40. Every group a program makes is made on every rank, in one order
    (``new_group`` is collective), so a rank's n-th request for ``(what, ranks)`` since the program
    began (``begin``) is the same request on every rank: it gets the n-th group made for it, made
    now if this process has not made that many. Two groups a program asks for apart stay apart. All
    of it belongs to the default group it was made under, and is forgotten with it."""

    def __init__(self) -> None:
        self.world: Any = None  # the default group the groups below were made under
        self.made: dict[tuple, list[Any]] = {}
        self.asked: dict[tuple, int] = {}

    def _current(self) -> None:
        world = _default_group()
        if world is not self.world:
            self.world, self.made, self.asked = world, {}, {}

    def begin(self) -> None:
        """A program begins asking for its groups."""
        self._current()
        self.asked = {}

    def get(self, what: str, ranks: tuple[int, ...], make: Any) -> Any:
        self._current()
        key = (what, ranks)
        n = self.asked.get(key, 0)
        self.asked[key] = n + 1
        made = self.made.setdefault(key, [])
        if n == len(made):
            made.append(make())
        return made[n]


GROUPS = _Groups()


def new_group(what: str, ranks: Sequence[int]) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` for ``what`` (a name of its use), reused from an earlier program
    when it asked for the same (``_Groups``). Collective: every rank asks, in one order."""
    ranks = tuple(ranks)
    return GROUPS.get(what, ranks, lambda: dist.new_group(list(ranks)))


def build_mesh(mesh: Mesh, ctx: DistContext) -> DeviceMesh | None:
    """The plan's mesh as a torch DeviceMesh (axes in ``MESH_ORDER``); None for one process. The
    first program of a mesh shape makes it; later ones reuse it (``_Groups``)."""
    if ctx.world_size == 1:
        return None
    return GROUPS.get("mesh", (ctx.device.type, *mesh.shape, *mesh.axis_names),
                      lambda: init_device_mesh(ctx.device.type, mesh.shape, mesh_dim_names=mesh.axis_names))


def expert_groups(mesh: Mesh, ctx: DistContext) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's expert group ("ep") and the group of dp ranks holding its experts ("edp"),
    core/mesh.py's rules."""
    mine = _own_groups(mesh, ctx, (MeshAxis.EP.value, MeshAxis.EDP.value))
    return mine[MeshAxis.EP.value], mine[MeshAxis.EDP.value]


def context_group(mesh: Mesh, ctx: DistContext) -> dist.ProcessGroup:
    """This rank's context-parallel group ("cp": cp consecutive dp ranks, core/mesh.py)."""
    return _own_groups(mesh, ctx, (MeshAxis.CP.value,))[MeshAxis.CP.value]


def _own_groups(mesh: Mesh, ctx: DistContext, axes: Sequence[str]) -> dict[str, dist.ProcessGroup]:
    """This rank's group along each of ``axes`` (core/mesh.py ``groups``); every group is created on
    every rank, in one order (``new_group``'s rule)."""
    mine = {}
    for axis in axes:
        for ranks in mesh.groups(axis):
            group = new_group(axis, ranks)
            if ctx.rank in ranks:
                mine[axis] = group
    return mine


def destroy(ctx: DistContext | None = None) -> None:
    """Tear down the default process group if there is one (and, given ``ctx``, only if ours)."""
    if ctx is not None and not ctx.initialized_here:
        return
    stop_watchdog()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
