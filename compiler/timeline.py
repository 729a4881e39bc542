"""The predicted pipeline schedule of a plan, as a timeline per stage, and a measured one from a trace.

``predicted_timeline(plan)`` reads ``plan.stages[*].forward_s/backward_s``,
``plan.training.schedule`` and ``plan.training.grad_accum_steps`` (the
micro-batches per step) and plays the schedule: each stage runs its
micro-batches' forwards and backwards in the schedule's order, a forward as
soon as the previous stage's forward of that micro-batch is done, a backward
as soon as the next stage's backward of it is done. Point-to-point sends are
taken as free (the plan's stage times already include them where the
planner counted them), so the timeline shows compute and bubbles only.

``load_trace(path)`` reads a measured Chrome/Perfetto trace the pipeline
runtime writes; ``measured_timeline(trace)`` turns it into the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita.core.errors import PlanError
from partita.core.files import read_user_text
from partita.core.plans.plan import Plan
from partita.core.plans.plan_file import MAX_PLAN_BYTES
from partita.core.schedule import BACKWARD, FORWARD, rank_order


@dataclass(frozen=True)
class Slot:
    """One micro-batch's forward or backward on one stage, in seconds from the step's start."""

    stage: int  # the row: the pipeline rank (the stage, with one chunk per rank)
    kind: str  # "forward" | "backward"
    microbatch: int
    start: float
    end: float
    chunk: int = -1  # the virtual stage it runs, under a chunked schedule (-1: the row's stage)


@dataclass(frozen=True)
class Timeline:
    schedule: str
    stages: int  # rows: pipeline ranks
    microbatches: int
    slots: tuple[Slot, ...]
    source: str = "predicted"  # or "measured (rank R)" per stage
    chunks: int = 1  # virtual stages per row (interleaved 1F1B)

    @property
    def makespan(self) -> float:
        return max((s.end for s in self.slots), default=0.0) - min((s.start for s in self.slots), default=0.0)

    def busy(self, stage: int) -> float:
        return sum(s.end - s.start for s in self.slots if s.stage == stage)

    def bubble_fraction(self, stage: int) -> float:
        """The share of the step this stage waits (idle between its first and the step's last op)."""
        span = self.makespan
        return 0.0 if span <= 0 else max(0.0, 1.0 - self.busy(stage) / span)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "stages": self.stages, "microbatches": self.microbatches, "chunks": self.chunks,
            "source": self.source, "makespan": self.makespan,
            "busy": [self.busy(s) for s in range(self.stages)],
            "bubble": [self.bubble_fraction(s) for s in range(self.stages)],
            # compact rows: stage (rank), 0 forward / 1 backward, micro-batch, start, end, virtual stage
            "slots": [[s.stage, 0 if s.kind == FORWARD else 1, s.microbatch, s.start, s.end,
                       s.stage if s.chunk < 0 else s.chunk] for s in self.slots],
        }


def _chunks(plan: Plan) -> int:
    """Virtual stages per row: the plan's chunks per rank where its stages are virtual, else 1."""
    return plan.training.chunks if len(plan.stages) == plan.virtual_stages else 1


def predicted_timeline(plan: Plan) -> Timeline:
    """Play the plan's schedule over its stages' forward and backward times: one row per pipeline
    rank, each (virtual) stage's forward after the previous stage's, its backward after the next's."""
    t = plan.training
    stages = plan.stages or ()
    V, M, v = max(1, len(stages)), t.grad_accum_steps, _chunks(plan)
    S = V // v
    fwd = [s.forward_s for s in stages] or [0.0]
    bwd = [0.0 if t.inference else s.backward_s for s in stages] or [0.0]
    orders = [rank_order(t.schedule, r, S, M, v, t.inference) for r in range(S)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    slots: list[Slot] = []
    pos, free = [0] * S, [0.0] * S
    while any(pos[r] < len(orders[r]) for r in range(S)):
        progressed = False
        for r in range(S):
            while pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                deps = [(FORWARD, c, mb)] if kind == BACKWARD else []
                if kind == FORWARD and c > 0:
                    deps.append((FORWARD, c - 1, mb))
                if kind == BACKWARD and c < V - 1:
                    deps.append((BACKWARD, c + 1, mb))
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                end = start + (fwd[c] if kind == FORWARD else bwd[c])
                done[(kind, c, mb)] = free[r] = end
                slots.append(Slot(r, kind, mb, start, end, c if v > 1 else -1))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {t.schedule} deadlocks with {S} stages and {M} micro-batches")
    return Timeline(t.schedule, S, M, tuple(sorted(slots, key=lambda x: (x.stage, x.start))), chunks=v)


# -- measured traces ------------------------------------------------------------


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a measured pipeline trace (Chrome/Perfetto JSON) and check its shape.

    Expected: ``{"traceEvents": [{"name", "cat": "forward"|"backward", "ph": "X",
    "ts": us, "dur": us, "pid": rank, "tid": stage, "args": {"stage", "microbatch", "rank"}}],
    "metadata": {"fingerprint", "mesh"}}``; events of other phases (``"M"`` metadata) are allowed
    and ignored.
    """
    path = Path(path)
    text = read_user_text(path, what="trace file", limit=MAX_PLAN_BYTES, error=PlanError,
                          hint="pass the path of a trace written by `partita run --trace`")
    try:
        data = json.loads(text)
    except RecursionError as e:
        raise PlanError(f"{path} is not a trace file: not UTF-8 JSON of a sane depth",
                        hint="pass the trace JSON the pipeline runtime wrote") from e
    except json.JSONDecodeError as e:
        raise PlanError(f"{path} is not a trace file: JSON error at line {e.lineno}, column {e.colno}: {e.msg}",
                        hint="pass the trace JSON the pipeline runtime wrote") from e
    check_trace(data, source=str(path))
    return data


def check_trace(data: Any, *, source: str = "trace") -> None:
    """Raise PlanError naming the first event (by index) that does not fit the trace format."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise PlanError(f"{source} is not a pipeline trace: expected an object with a \"traceEvents\" list",
                        hint="pass the trace JSON the pipeline runtime wrote")
    meta = data.get("metadata", {})
    if not isinstance(meta, dict):
        raise PlanError(f"{source}: \"metadata\" must be an object, got {type(meta).__name__}",
                        hint="pass a trace written by `partita run --trace`")
    spans = 0
    for i, ev in enumerate(data["traceEvents"]):
        if not isinstance(ev, dict):
            raise PlanError(f"{source}: traceEvents[{i}] is not an object",
                            hint="pass a trace written by `partita run --trace`")
        if ev.get("ph") != "X":
            continue
        if ev.get("cat") not in (FORWARD, BACKWARD):
            raise PlanError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) has cat {ev.get('cat')!r}; "
                            f"expected \"forward\" or \"backward\"",
                                hint="pass a trace written by `partita run --trace`")
        for key in ("ts", "dur"):
            if not isinstance(ev.get(key), (int, float)) or isinstance(ev.get(key), bool) or ev[key] < 0:
                raise PlanError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) needs a non-negative "
                                f"number \"{key}\" (microseconds), got {ev.get(key)!r}",
                                    hint="pass a trace written by `partita run --trace`")
        args = ev.get("args")
        if not isinstance(args, dict):
            raise PlanError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) has no \"args\" object",
                            hint="pass a trace written by `partita run --trace`")
        for key in ("stage", "microbatch"):
            v = args.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise PlanError(f"{source}: traceEvents[{i}] ({ev.get('name')!r}) needs a non-negative integer "
                                f"args.{key}, got {v!r}", hint='pass a trace written by `partita run --trace`')
        spans += 1
    if not spans:
        raise PlanError(f"{source} has no forward or backward spans (events with \"ph\": \"X\")",
                        hint="pass a trace written by `partita run --trace`")


def trace_rank(ev: Mapping[str, Any]) -> int:
    return int(ev["args"].get("rank", ev.get("pid", 0)))


def measured_timeline(trace: Mapping[str, Any], plan: Plan) -> Timeline:
    """The measured schedule, one row per stage from the lowest rank that ran it, from the trace's first span.

    Refuses a trace recorded for another model or with stages the plan does not have.
    """
    check_trace(trace)
    fp = trace.get("metadata", {}).get("fingerprint")
    if fp is not None and fp != plan.model.fingerprint:
        raise PlanError(f"the trace was recorded for graph fingerprint {fp}, "
                        f"but the plan is for {plan.model.fingerprint} ({plan.model.name})",
                        hint="pass the trace of a run of this plan")
    spans = [ev for ev in trace["traceEvents"] if ev.get("ph") == "X"]
    S = max(1, len(plan.stages))
    bad = sorted({ev["args"]["stage"] for ev in spans if ev["args"]["stage"] >= S})
    if bad:
        raise PlanError(f"the trace has stage(s) {bad}, but the plan has {S} stage(s)",
                        hint="pass the trace of a run of this plan")
    rank_of_stage: dict[int, int] = {}
    for ev in spans:
        s = ev["args"]["stage"]
        rank_of_stage[s] = min(rank_of_stage.get(s, trace_rank(ev)), trace_rank(ev))
    t0 = min(ev["ts"] for ev in spans)
    v = _chunks(plan)
    rows = S // v  # one per pipeline rank: virtual stage c on row c mod rows
    slots = tuple(sorted(
        (Slot(ev["args"]["stage"] % rows, ev["cat"], ev["args"]["microbatch"], (ev["ts"] - t0) / 1e6,
              (ev["ts"] + ev["dur"] - t0) / 1e6, ev["args"]["stage"] if v > 1 else -1)
         for ev in spans if trace_rank(ev) == rank_of_stage[ev["args"]["stage"]]),
        key=lambda x: (x.stage, x.start)))
    ranks = ", ".join(f"stage {s}: rank {r}" for s, r in sorted(rank_of_stage.items()))
    M = 1 + max(s.microbatch for s in slots)
    return Timeline(plan.training.schedule, rows, M, slots, source=f"measured ({ranks})", chunks=v)
