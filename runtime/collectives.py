"""What a rank's collectives cost it: every call counted by (kind, axis, bytes) and every wait timed.

Each axis file records the collectives it issues here (``CollectiveCounter.record``), so a step's
calls can be compared with the plan's ``collectives`` list call for call, and each call is logged
in the flight recorder that the watchdog reads (runtime/watchdog.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from partita.runtime.watchdog import FLIGHT


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
