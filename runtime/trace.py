"""Per-micro-batch timings of a run, written as a Chrome/Perfetto trace.

Every rank records one span per micro-batch forward and backward it ran
(compute only: waiting for a neighbour's activation or gradient is the gap
between spans, which is what the pipeline bubble is made of). ``write`` gathers
all ranks' spans to rank 0, which writes the file that ``partita view`` reads
(compiler/timeline.py ``load_trace``):

    {"traceEvents": [{"name": "F3", "cat": "forward" | "backward", "ph": "X",
                      "ts": us, "dur": us, "pid": rank, "tid": stage,
                      "args": {"stage": s, "microbatch": m, "rank": r, "step": k}}],
     "metadata": {"fingerprint": plan.model.fingerprint, "mesh": {"dp", "tp", "pp"}}}

Timestamps are wall-clock microseconds (``time.time_ns``), comparable between
the processes of one machine.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from partita.core.plans.plan import Plan
from partita.core.schedule import FORWARD
from partita.runtime.processes.watchdog import FLIGHT


class TraceRecorder:
    """This rank's spans, one per micro-batch forward / backward, for every step so far."""

    def __init__(self, rank: int, stage: int) -> None:
        self.rank = rank
        self.stage = stage
        self.step = 0
        self.events: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def span(self, cat: str, microbatch: int, chunk: int | None = None) -> Iterator[None]:
        """Time one forward or backward; ``chunk``: its virtual stage, where the rank runs several."""
        FLIGHT.at(self.step, cat, microbatch)  # progress, for the watchdog
        t0 = time.time_ns()
        yield
        t1 = time.time_ns()
        self.events.append({
            "name": f"{'F' if cat == FORWARD else 'B'}{microbatch}", "cat": cat, "ph": "X",
            "ts": t0 / 1e3, "dur": (t1 - t0) / 1e3, "pid": self.rank, "tid": self.stage,
            "args": {"stage": self.stage if chunk is None else chunk, "microbatch": microbatch, "rank": self.rank,
                     "step": self.step},
        })

    def write(self, path: str | Path, plan: Plan) -> Path | None:
        """Gather every rank's spans to rank 0 and write the trace there (collective: call on all ranks).

        Returns the path on rank 0, None elsewhere."""
        events = list(self.events)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(events, parts, dst=0)
            if dist.get_rank() != 0:
                return None
            events = [ev for part in parts for ev in part]
        m = plan.mesh
        data = {"traceEvents": sorted(events, key=lambda ev: (ev["pid"], ev["ts"])),
                "metadata": {"fingerprint": plan.model.fingerprint, "mesh": {"dp": m.dp, "tp": m.tp, "pp": m.pp},
                             "schedule": plan.training.schedule,
                             "micro_batches": plan.training.grad_accum_steps}}
        path = Path(path)
        path.write_text(json.dumps(data))
        return path


class DispatchCount(TorchDispatchMode):
    """The aten ops dispatched inside the block, by op (``count`` in all): on a CPU the proxy for
    the kernels a step launches on a GPU (benchmarks/dispatch_count.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
