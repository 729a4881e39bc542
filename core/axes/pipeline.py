"""Pipeline parallelism: the model cut into ``pp`` stages (x chunks per rank) run by a schedule
(core/schedule.py)."""

from __future__ import annotations

from partita.core.axes.rules import Axis, Rule
from partita.core.schedule import CHUNKED, SCHEDULES, chunk_problem

SCHEDULE_WITHOUT_STAGES = Rule(
    ("schedule", "pp"), lambda v: v["schedule"] != "none" and v["pp"] == 1,
    lambda say, v: f"{say('schedule')} schedules pipeline stages, but {say('pp')} has none",
    "pin --pp 2 or more, or drop --schedule")


def _ungrouped(schedule: str, pp: int, micro_batches: int) -> bool:
    """A chunked schedule runs its micro-batches in groups of pp (core/schedule.py ``chunk_problem``)."""
    return schedule in CHUNKED and pp > 1 and micro_batches % pp != 0


MICRO_BATCH_GROUPS = Rule(
    ("schedule", "pp", "grad_accum_steps"), lambda v: _ungrouped(v["schedule"], v["pp"], v["grad_accum_steps"]),
    lambda say, v: f"{say('schedule')} runs micro-batches in groups of {say('pp')}: {say('grad_accum_steps')} "
                   "is not a multiple",
    "pin --grad-accum-steps a multiple of --pp, or leave it out")


def _plan_checks(plan) -> list[str]:
    t, out = plan.training, []
    if plan.mesh.pp > 1 and not t.inference and t.schedule not in SCHEDULES:
        out.append(f"mesh.pp = {plan.mesh.pp} needs a pipeline schedule ({', '.join(SCHEDULES)}), "
                   f"not training.schedule = {t.schedule!r}")
    problem = chunk_problem(t.schedule, plan.mesh.pp, t.chunks, t.grad_accum_steps)
    if problem and not t.inference and not _ungrouped(t.schedule, plan.mesh.pp, t.grad_accum_steps):
        # (not grouped by pp: MICRO_BATCH_GROUPS says so)
        out.append(problem)
    if t.chunks > 1:  # compile cuts no chunk without parameters (passes/pipeline/cuts.py ``Partition.empty``)
        out += [f"stages[{s.index}].params = 0 under training.chunks = {t.chunks}: every chunk of a chunked "
                "schedule holds parameters of its own" for s in plan.stages if not s.params]
    return out


def _describe(plan) -> str | None:
    t = plan.training
    if plan.mesh.pp == 1:
        return None
    chunks = f", {t.chunks} chunks per rank" if t.chunks > 1 else ""
    return f"pp = {plan.mesh.pp}: {t.schedule}{chunks}, {t.grad_accum_steps} micro-batches"


AXIS = Axis("pipeline parallelism", ("pp", "schedule"), (SCHEDULE_WITHOUT_STAGES, MICRO_BATCH_GROUPS), _plan_checks,
            _describe)
