"""Process group and device mesh for one rank.

``init_distributed`` is the only place the runtime starts torch.distributed.
Under torchrun (``WORLD_SIZE``/``RANK`` in the environment) it joins the
default process group; outside it, it returns a single-process context and
starts nothing, so a script written for partita also runs as a plain script.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partita.core.errors import PartitaError
from partita.core.plan import Mesh
from partita.runtime.watchdog import stop as stop_watchdog
from partita.runtime.watchdog import timeout_from_env


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
    runtime/watchdog.py) plus a minute, so the watchdog, which names the stuck
    collective on every rank, always speaks first; 2 minutes with the watchdog off.
    """
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
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return DistContext(0, 1, 0, "none", _device(0), False)
    backend = _backend()
    device = _device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    # A user's script seldom tears the group down; collectives still in flight at interpreter
    # exit (ZeRO-3's parameter gathers) then abort the process. Tear it down at exit instead.
    atexit.register(_destroy_at_exit)
    _one_message_for_user_errors(dist.get_rank())
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device, True)


def _one_message_for_user_errors(rank: int) -> None:
    """A ``PartitaError`` no code caught ends this rank with exit code 2 and no traceback: under
    ``partita run`` its message goes to the run's error folder, and the launcher prints each
    distinct message once (runtime/launch.py); under a plain torchrun rank 0 prints it."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, PartitaError):
            previous(kind, value, tb)
            return
        folder = os.environ.get("PARTITA_ERROR_DIR")
        if folder and Path(folder).is_dir():
            Path(folder, f"rank{rank}.txt").write_text(str(value))
        elif rank == 0:
            print(f"error: {value}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(value.exit_code)  # without atexit's teardown: peers may be gone already

    sys.excepthook = hook


def _destroy_at_exit() -> None:
    stop_watchdog()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def build_mesh(mesh: Mesh, ctx: DistContext) -> DeviceMesh | None:
    """The plan's mesh as a torch DeviceMesh (axes in ``MESH_ORDER``); None for one process."""
    if ctx.world_size == 1:
        return None
    return init_device_mesh(ctx.device.type, mesh.shape, mesh_dim_names=mesh.axis_names)


def destroy(ctx: DistContext | None = None) -> None:
    """Tear down the default process group if there is one (and, given ``ctx``, only if ours)."""
    if ctx is not None and not ctx.initialized_here:
        return
    stop_watchdog()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
