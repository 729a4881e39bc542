"""Frozen dataclasses to JSON data and back, by their type hints: what ``Plan.to_dict`` and
``Plan.from_dict`` (core/plans/plan.py) are made of.

Dataclasses become objects, enums their values, tuples lists; reading builds each field's type
again (a nested dataclass, ``tuple[X, ...]``, ``Mapping[str, X]``, ``X | None``) and refuses a
field the dataclass does not have. The plan's schema checks the data before it is read.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any


def to_jsonable(obj: Any) -> Any:
    """``obj`` as JSON data: dataclasses and mappings as objects, tuples and lists as arrays."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def from_jsonable(tp: Any, value: Any) -> Any:
    """JSON data ``value`` as type ``tp``; ``TypeError`` or ``KeyError`` where it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return from_jsonable(args[0], value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise TypeError(f"{tp.__name__} must be an object, got {value!r}")
        hints = _type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise KeyError(f"unknown field(s) {sorted(unknown)} in {tp.__name__}")
        return tp(**{k: from_jsonable(hints[k], v) for k, v in value.items()})
    if origin is tuple:
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        return tuple(from_jsonable(inner, v) for v in value)
    if origin in (Mapping, dict) or tp is Mapping:
        args = typing.get_args(tp)
        inner = args[1] if len(args) == 2 else Any
        return {k: from_jsonable(inner, v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value


@functools.cache
def _type_hints(tp: type) -> dict[str, Any]:
    """A dataclass's field types, resolved once (its module's names, so string annotations work)."""
    return typing.get_type_hints(tp)
