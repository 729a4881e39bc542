"""What a rank's collectives cost it: every call counted by (kind, axis, bytes) and every wait timed.

Each axis file records the collectives it issues here (``CollectiveCounter.record``), so a step's
calls can be compared with the plan's ``collectives`` list call for call, and each call is logged
in the flight recorder that the watchdog reads (runtime/processes/watchdog.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from partita.runtime.processes.watchdog import FLIGHT


@dataclass
class CollectiveCounter:
    """Collectives this rank issued: (kind, axis, bytes per call) -> calls."""

    calls: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # (kind, axis) -> seconds blocked in such calls

    @contextlib.contextmanager
    def blocking(self, kind: str, axis: str) -> Iterator[None]:
        """Time a wait for a ``kind`` collective over ``axis`` (what a step spends in them, measured)."""
        t0 = time.perf_counter()
        yield
        self.seconds[(kind, axis)] += time.perf_counter() - t0

    def record(self, kind: str, axis: str, nbytes: int, ranks: tuple[int, ...] | None = None) -> None:
        """Count one call, and log it in the flight recorder the watchdog reads (``ranks``: its group,
        when not this rank's whole ``axis``)."""
        self.calls[(kind, axis, nbytes)] += 1
        FLIGHT.entered(kind, axis, nbytes, ranks)

    def reset(self) -> None:
        self.calls.clear()
        self.seconds.clear()

    def as_tuples(self) -> list[tuple[str, str, int, int]]:
        """Sorted (kind, axis, bytes, calls), comparable with a plan's ``collectives``."""
        return sorted((k, a, b, n) for (k, a, b), n in self.calls.items())


# The flat all-gather and reduce-scatter under the names this torch has: 2.13 renamed them
# (``all_gather_single``, ``reduce_scatter_single``) and warns on the old ones, 2.11 has only the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's ``inp`` into ``out``, concatenated along dim 0 (one call, any supported torch)."""
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """This rank's dim-0 slice of the sum of every rank's ``inp`` into ``out`` (one call, any supported torch)."""
    return _reduce_scatter(out, inp, group=group, async_op=async_op)
