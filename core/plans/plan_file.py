"""Reading a plan file back: its JSON parsed within a size limit, checked against
``plan_schema.json``, built into a ``Plan`` (core/plans/plan.py), checked by the planner's rules (which
core/plans/verify.py passes in) and by its seal. Loading refuses, saying what differs, another schema
``version``, model (graph fingerprint) or world size.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from partita.core.errors import PlanError
from partita.core.files import read_user_text
from partita.core.plans.plan import SCHEMA_VERSION, SEAL, Plan, seal_digest

SCHEMA_PATH = Path(__file__).with_name("plan_schema.json")
MAX_PLAN_BYTES = 1 << 30  # a plan file larger than this is not one partita wrote


def read_plan(
    path: str | Path, *, fingerprint: str | None = None, world_size: int | None = None, sealed: bool = True,
    verify: Callable[[Plan], list[str]] | None = None,
) -> Plan:
    """Read and validate a plan file (``plan_from_data``); optionally check it against a model and
    world size. Every caller outside core/ loads through ``core.verify.load_plan``, which passes
    the planner's own rules as ``verify``. ``sealed=False`` skips only the seal (`partita verify`)."""
    plan = plan_from_data(read_plan_data(path), source=str(path), sealed=sealed, verify=verify)
    plan.check_matches(fingerprint=fingerprint, world_size=world_size)
    return plan


def read_plan_data(path: str | Path) -> Any:
    """A plan file's parsed JSON, or ``PlanError`` saying why it cannot be read."""
    path = Path(path)
    broken = "the file may be truncated or edited by hand; recompile it with `partita compile`"
    text = read_user_text(path, what="plan file", limit=MAX_PLAN_BYTES, error=PlanError,
                          hint="pass the path of a plan file `partita compile` wrote")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(
            f"{path} is not a valid plan file: JSON error at line {e.lineno}, column {e.colno}: {e.msg}",
            hint=broken,
        ) from e
    except RecursionError as e:
        raise PlanError(f"{path} is not a plan file: its JSON nests too deeply", hint=broken) from e


def plan_from_data(data: Any, *, source: str = "plan", sealed: bool = True,
                   verify: Callable[[Plan], list[str]] | None = None) -> Plan:
    """Validate parsed JSON against the schema, build a ``Plan``, refuse it if ``verify`` (the
    planner's rules, core/plans/verify.py) finds problems, then check its seal unless ``sealed`` is False."""
    if not isinstance(data, dict):
        raise PlanError(f"{source} is not a plan file: expected a JSON object, got {type(data).__name__}",
                        hint="pass a plan file `partita compile` wrote")
    version = data.get("version")
    if version != SCHEMA_VERSION:
        raise PlanError(
            f"{source} has plan format version {_short(repr(version))}; this partita reads version {SCHEMA_VERSION}",
            hint="recompile the plan with this version of partita",
        )
    import jsonschema

    try:
        _plan_validator().validate(data)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise PlanError(
            f"{source} is not a valid plan file: at {_short(where)}: {_short(e.message)}",
            hint="recompile it with `partita compile`",
        ) from e
    except RecursionError as e:
        raise PlanError(f"{source} is not a plan file: its JSON nests too deeply",
                        hint="recompile it with `partita compile`") from e
    try:
        plan = Plan.from_dict(data)
    except (ValueError, TypeError, KeyError) as e:
        raise PlanError(f"{source} is not a consistent plan: {_short(str(e))}",
                        hint="recompile it with `partita compile`") from e
    if data.get("world_size") not in (None, plan.world_size):
        raise PlanError(
            f"{source} is not a consistent plan: world_size {data['world_size']} "
            f"but mesh {plan.mesh} has {plan.world_size} devices",
            hint="recompile it with `partita compile`",
        )
    problems = verify(plan) if verify is not None else []
    if problems:
        raise PlanError(f"{source} is not a consistent plan: {describe_problems(problems)}",
                        hint="recompile it with `partita compile` (or undo the hand edit)")
    if sealed and data.get(SEAL) != seal_digest(data):
        what = "has no seal" if SEAL not in data else "was changed after it was sealed (its sha256 does not match)"
        raise PlanError(f"{source} {what}: a plan is run only as `partita compile` or `partita verify` wrote it",
                        hint=f"check the edit, then run `partita verify {source}` to verify it and seal it again")
    return plan


@functools.lru_cache(maxsize=1)
def _plan_validator() -> Any:
    """The schema's validator, with "integer" meaning a JSON integer (jsonschema also takes 8.0:
    a count written as a float is no count partita wrote)."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text())
    base = jsonschema.validators.validator_for(schema)
    checker = base.TYPE_CHECKER.redefine("integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(base, type_checker=checker)(schema)


def describe_problems(problems: list[str], limit: int = 5) -> str:
    """The first problems found, and how many more."""
    more = len(problems) - limit
    return "; ".join(problems[:limit]) + (f"; and {more} more" if more > 0 else "")


def _short(value: Any, limit: int = 200) -> str:
    """``value`` as text of at most ``limit`` characters (a hostile file can make any field huge)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"
