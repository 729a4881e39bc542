"""Pipeline schedules: their names, each stage's order of forwards and backwards, and how many
micro-batches' activations a stage holds at its peak.

One home for what the cost model prices (passes/cost_model.py: memory in flight,
the bubble), the runtime runs (runtime/pipeline/stage.py walks ``rank_order``)
and the viewer draws (compiler/timeline.py plays ``rank_order`` over the plan's
stage times), so the three cannot disagree on a schedule.

GPipe runs every micro-batch's forward, then every backward: a stage holds all m
micro-batches' activations. 1F1B (PipeDream-flush, Narayanan et al.: docs/references.md) fills the
pipe with p - 1 - i forwards on stage i of p, then alternates one forward and one
backward, then drains: stage i holds min(p - i, m). Interleaved 1F1B (Narayanan et al.,
SC'21) cuts the model into p v chunks (virtual stages), chunk c on pipeline rank c mod p,
and runs 1F1B over them in groups of p micro-batches: the bubble is (p - 1) / (v m), at v
times the sends. "none" is no pipeline: one micro-batch at a time, gradients accumulated.

A rank's order is ``rank_order``: (action, micro-batch, virtual stage) triples; with one chunk
per rank the virtual stage is the rank's own stage. How a new schedule plugs in:
docs/adding-a-schedule.md.
"""

from __future__ import annotations

import functools

GPIPE = "gpipe"
ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved-1f1b"
NONE = "none"
# the pipeline schedules, in the order the planner weighs them
SCHEDULES: tuple[str, ...] = (ONE_F_ONE_B, INTERLEAVED, GPIPE)
# schedules running several model chunks per rank -> the fewest chunks per rank (v) they run
CHUNKED: dict[str, int] = {INTERLEAVED: 2}
# the most chunks per rank the planner weighs: the bubble falls as 1 / v, the sends grow as v
# (Megatron-LM runs its published GPT-3 and Llama 3 configurations at 2 to 8 layers' chunks)
MAX_CHUNKS = 8

FORWARD, BACKWARD = "forward", "backward"


def check_schedule(schedule: str, *, allow_none: bool = True) -> None:
    """``ValueError`` unless ``schedule`` is a pipeline schedule (or "none" where allowed)."""
    known = SCHEDULES + ((NONE,) if allow_none else ())
    if schedule not in known:
        raise ValueError(f"schedule {schedule!r} is not one of {', '.join(known)}")


def chunks_of(schedule: str) -> int:
    """The fewest model chunks per pipeline rank ``schedule`` runs (1 but for a chunked one)."""
    return CHUNKED.get(schedule, 1)


def chunk_counts(schedule: str) -> range:
    """The chunks per pipeline rank the planner weighs for ``schedule``: 1, or for a chunked one every
    count from its fewest to ``MAX_CHUNKS`` (each cut where the model has parts enough)."""
    return range(chunks_of(schedule), MAX_CHUNKS + 1) if schedule in CHUNKED else range(1, 2)


def chunk_problem(schedule: str, ranks: int, chunks: int, micro_batches: int) -> str | None:
    """Why ``chunks`` chunks per rank cannot run ``schedule`` over ``ranks`` pipeline ranks and
    ``micro_batches`` micro-batches, or None: a chunked schedule needs at least 2 chunks, 2 ranks and
    whole groups of ``ranks`` micro-batches; the others one chunk."""
    if schedule not in CHUNKED:
        return None if chunks == 1 else f"schedule {schedule!r} runs one chunk per rank, not {chunks}"
    if chunks < 2 or ranks < 2:
        return f"{schedule} needs at least 2 chunks per rank and 2 pipeline ranks, not {chunks} and {ranks}"
    if micro_batches % ranks:
        return f"{schedule} runs micro-batches in groups of pp={ranks}: {micro_batches} is not a multiple"
    return None


def warmup(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Forwards stage (rank) ``stage`` runs before its first backward (beyond the one it pairs with);
    under interleaved 1F1B counted in chunk forwards (Megatron-LM's 2 (p - 1 - i) + (v - 1) p)."""
    if schedule == GPIPE:
        return micro_batches
    if schedule == ONE_F_ONE_B:
        return min(stages - stage - 1, micro_batches)
    if schedule == INTERLEAVED:
        return min(2 * (stages - stage - 1) + (chunks - 1) * stages, micro_batches * chunks)
    return 0


def stage_order(schedule: str, stage: int, stages: int, micro_batches: int,
                inference: bool = False) -> list[tuple[str, int]]:
    """Stage ``stage``'s actions in order: (FORWARD, k) / (BACKWARD, k) of micro-batch k.

    Inference runs the forwards alone. With one stage 1F1B is forward then backward
    per micro-batch, as "none" is. A chunked schedule's order is ``rank_order``'s."""
    check_schedule(schedule)
    if schedule in CHUNKED:
        raise ValueError(f"{schedule} runs several chunks per rank: its order is rank_order's")
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


def rank_order(schedule: str, rank: int, ranks: int, micro_batches: int, chunks: int = 1,
               inference: bool = False) -> list[tuple[str, int, int]]:
    """Pipeline rank ``rank``'s actions in order: (FORWARD | BACKWARD, micro-batch, virtual stage).

    With one chunk per rank, ``stage_order`` with the rank as the stage. Interleaved 1F1B
    (Megatron-LM's order): the i-th forward is of chunk (i // p) mod v, micro-batch
    (i // (p v)) p + i mod p; backwards take the chunks in reverse; ``warmup`` forwards, then one
    forward and one backward, then the remaining backwards. Every rank sends and receives in the
    same (chunk, micro-batch) order, so the sends between two ranks arrive in the order they
    are received."""
    if schedule not in CHUNKED:
        if chunks != 1:
            raise ValueError(chunk_problem(schedule, ranks, chunks, micro_batches))
        return [(a, k, rank) for a, k in stage_order(schedule, rank, ranks, micro_batches, inference)]
    problem = chunk_problem(schedule, ranks, chunks, micro_batches)
    if problem:
        raise ValueError(problem)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not in 0..{ranks - 1}")
    p, v, total = ranks, chunks, micro_batches * chunks

    def op(i: int, backward: bool) -> tuple[int, int]:
        group = i // p
        chunk = v - 1 - group % v if backward else group % v
        return (group // v) * p + i % p, chunk * p + rank

    if inference:
        return [(FORWARD, *op(i, False)) for i in range(total)]
    w = warmup(schedule, rank, p, micro_batches, v)
    order = [(FORWARD, *op(i, False)) for i in range(w)]
    for i in range(total - w):
        order += [(FORWARD, *op(w + i, False)), (BACKWARD, *op(i, True))]
    return order + [(BACKWARD, *op(i, True)) for i in range(total - w, total)]


def steady(ranks: int, micro_batches: int, chunks: int) -> int:
    """The micro-batches to walk a chunked order over to count what it holds: the counts stop
    changing once m reaches 2 p (a test walks up to 40 p), so m is capped at 2 (v + 1) p; the
    planner asks with m up to the global batch, which may be 10^14."""
    return min(micro_batches, 2 * (chunks + 1) * ranks)


@functools.lru_cache(maxsize=4096)
def _chunk_peaks(schedule: str, rank: int, ranks: int, micro_batches: int, chunks: int) -> tuple[int, ...]:
    """Each chunk's micro-batches in flight when the rank's total first peaks (walking ``rank_order``)."""
    live, best, peak = [0] * chunks, (0,) * chunks, -1
    for action, _, c in rank_order(schedule, rank, ranks, micro_batches, chunks):
        live[c // ranks] += 1 if action == FORWARD else -1
        if sum(live) > peak:
            peak, best = sum(live), tuple(live)
    return best


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Micro-batches whose saved activations stage ``stage`` (0-based) of ``stages`` holds at its
    peak: the most forwards ``stage_order`` runs ahead of their backwards, in closed form (the
    planner's inner loops call it): m under GPipe, min(p - i, m) under 1F1B, 1 without a pipeline.
    A chunked schedule: ``stage`` is a virtual stage of ``stages`` = p v, and the count is its
    chunk's share of its rank's peak (walked once, cached): summed over a rank's chunks, the
    rank's peak in chunk micro-batches."""
    check_schedule(schedule)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    if schedule in CHUNKED:
        p = stages // chunks
        return _chunk_peaks(schedule, stage % p, p, steady(p, micro_batches, chunks), chunks)[stage // p]
    if schedule == NONE:
        return 1
    if schedule == GPIPE:
        return micro_batches
    return min(stages - stage, micro_batches)


def bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle time over useful time of a pipeline: (p - 1) / m (GPipe and 1F1B alike), (p - 1) / (v m)
    interleaved over v chunks per rank (Narayanan et al., SC'21)."""
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError(f"stages={stages}, micro_batches={micro_batches} and chunks={chunks} must be at least 1")
    return (stages - 1) / (chunks * micro_batches)


def gradients_received(schedule: str, rank: int, ranks: int, micro_batches: int,
                       chunks: int = 1) -> dict[tuple[int, int], int]:
    """(virtual stage, micro-batch) of each forward of rank ``rank`` that receives activations from
    the previous rank -> how many of the gradients ``rank`` sent back to that rank it has received
    by then: the backwards the previous rank ran before it sent them (each takes one gradient
    from ``rank``, but the last virtual stage's). runtime/pipeline/stage.py lets those sends go."""
    p, last = ranks, ranks * chunks - 1
    before, out = 0, {}
    for action, k, c in rank_order(schedule, (rank - 1) % p, p, micro_batches, chunks):
        if action == FORWARD:
            if c < last:
                out[c + 1, k] = before
        elif c < last:
            before += 1
    return out


@functools.lru_cache(maxsize=4096)
def _walk_sends(schedule: str, rank: int, ranks: int, micro_batches: int, chunks: int) -> tuple[tuple[int, int], ...]:
    """Per chunk of the rank, the most (activation, gradient) sends it holds at once, walking
    ``rank_order`` with the runtime's releases: activations at their backward, gradients once
    ``gradients_received`` says the previous rank had them."""
    p, last = ranks, ranks * chunks - 1
    received = gradients_received(schedule, rank, p, micro_batches, chunks) if p > 1 else {}
    forward, most_f, most_b = [0] * chunks, [0] * chunks, [0] * chunks
    sent: list[int] = []  # the chunk of each gradient send, in order
    let_go = 0
    for action, k, c in rank_order(schedule, rank, p, micro_batches, chunks):
        j = c // p
        if action == FORWARD:
            let_go = max(let_go, received.get((c, k), 0))
            if c < last:
                forward[j] += 1
                most_f[j] = max(most_f[j], forward[j])
        else:
            if c < last:
                forward[j] -= 1
            if c > 0:
                sent.append(j)
                most_b[j] = max(most_b[j], sent[let_go:].count(j))
    return tuple(zip(most_f, most_b))


def sends_held(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> tuple[int, int]:
    """The most micro-batches' sends stage ``stage`` holds at once: (activations sent forward,
    let go at that micro-batch's backward; gradients sent back, let go when the previous stage's
    activations show it has run those backwards: ``gradients_received``). What walking
    ``stage_order`` gives, in closed form (the planner's inner loops call it, with m up to the
    batch): under 1F1B min(p - i, m) and min(p - i + 1, m) (the previous stage runs one forward
    ahead of the backward the release waits for), under GPipe m and m; none past the ends.
    A chunked schedule (``stage`` a virtual stage of p v): its chunk's most, walked (``_walk_sends``)."""
    check_schedule(schedule)
    p, m = stages, micro_batches
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is not in 0..{p - 1}")
    if schedule in CHUNKED:
        ranks = stages // chunks
        return _walk_sends(schedule, stage % ranks, ranks, steady(ranks, m, chunks), chunks)[stage // ranks]
    if schedule == NONE or p == 1:
        return 0, 0
    forward = 0 if stage == p - 1 else (m if schedule == GPIPE else min(p - stage, m))
    backward = 0 if stage == 0 else (m if schedule == GPIPE else min(p - stage + 1, m))
    return forward, backward
