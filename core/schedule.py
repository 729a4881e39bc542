"""Pipeline schedules: their names, each stage's order of forwards and backwards, and how many
micro-batches' activations a stage holds at its peak.

One home for what the cost model prices (passes/cost_model.py: memory in flight,
the bubble), the runtime runs (runtime/pipeline/stage.py walks ``stage_order``)
and the viewer draws (compiler/timeline.py plays ``stage_order`` over the plan's
stage times), so the three cannot disagree on a schedule.

GPipe runs every micro-batch's forward, then every backward: a stage holds all m
micro-batches' activations. 1F1B (PipeDream-flush, Narayanan et al.: docs/references.md) fills the
pipe with p - 1 - i forwards on stage i of p, then alternates one forward and one
backward, then drains: stage i holds min(p - i, m). "none" is no pipeline: one
micro-batch at a time, gradients accumulated.
"""

from __future__ import annotations

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
NONE = "none"
SCHEDULES: tuple[str, ...] = (ONE_F_ONE_B, GPIPE)  # the pipeline schedules, in the order the planner weighs them

FORWARD, BACKWARD = "forward", "backward"


def check_schedule(schedule: str, *, allow_none: bool = True) -> None:
    """``ValueError`` unless ``schedule`` is a pipeline schedule (or "none" where allowed)."""
    known = SCHEDULES + ((NONE,) if allow_none else ())
    if schedule not in known:
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(known)}")


def warmup(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Forwards stage ``stage`` runs before its first backward (beyond the one it pairs with)."""
    if schedule == GPIPE:
        return micro_batches
    if schedule == ONE_F_ONE_B:
        return min(stages - stage - 1, micro_batches)
    return 0


def stage_order(schedule: str, stage: int, stages: int, micro_batches: int,
                inference: bool = False) -> list[tuple[str, int]]:
    """Stage ``stage``'s actions in order: (FORWARD, k) / (BACKWARD, k) of micro-batch k.

    Inference runs the forwards alone. With one stage 1F1B is forward then backward
    per micro-batch, as "none" is."""
    check_schedule(schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    m = micro_batches
    if inference:
        return [(FORWARD, k) for k in range(m)]
    w = warmup(schedule, stage, stages, m)
    order = [(FORWARD, k) for k in range(w)]
    for k in range(w, m):
        order += [(FORWARD, k), (BACKWARD, k - w)]
    return order + [(BACKWARD, k) for k in range(m - w, m)]


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose saved activations stage ``stage`` (0-based) of ``stages`` holds at its
    peak: the most forwards ``stage_order`` runs ahead of their backwards, in closed form (the
    planner's inner loops call it): m under GPipe, min(p - i, m) under 1F1B, 1 without a pipeline."""
    check_schedule(schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if schedule == NONE:
        return 1
    if schedule == GPIPE:
        return micro_batches
    return min(stages - stage, micro_batches)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle time over useful time of a pipeline: (p - 1) / m (GPipe and 1F1B alike)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages={stages} and micro_batches={micro_batches} must be at least 1")
    return (stages - 1) / micro_batches


def backwards_done_before(schedule: str, stage: int, stages: int, micro_batches: int) -> dict[int, int]:
    """Micro-batch k -> how many backwards stage ``stage`` has run before its forward of k: once
    the next stage receives k's activations, the gradients it sent back for the micro-batches
    below that count have been received (runtime/pipeline/stage.py lets them go then)."""
    out, done = {}, 0
    for action, k in stage_order(schedule, stage, stages, micro_batches):
        if action == FORWARD:
            out[k] = done
        else:
            done += 1
    return out


def sends_held(schedule: str, stage: int, stages: int, micro_batches: int) -> tuple[int, int]:
    """The most micro-batches' sends stage ``stage`` holds at once: (activations sent forward,
    let go at that micro-batch's backward; gradients sent back, let go when the previous stage's
    activations show it has run those backwards: ``backwards_done_before``). What walking
    ``stage_order`` gives, in closed form (the planner's inner loops call it, with m up to the
    batch): under 1F1B min(p - i, m) and min(p - i + 1, m) (the previous stage runs one forward
    ahead of the backward the release waits for), under GPipe m and m; none past the ends."""
    check_schedule(schedule)
    p, m = stages, micro_batches
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is not in 0..{p - 1}")
    if schedule == NONE or p == 1:
        return 0, 0
    forward = 0 if stage == p - 1 else (m if schedule == GPIPE else min(p - stage, m))
    backward = 0 if stage == 0 else (m if schedule == GPIPE else min(p - stage + 1, m))
    return forward, backward
