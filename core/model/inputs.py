"""Example-input specifications: ``NAME=DTYPE[SHAPE]``.

A model is captured against inputs described only by name, dtype and shape
(``idx=int64[8,128]``, ``x=float32[4, 3, 32, 32]``); no data is needed because
capture runs on fake tensors. The text form is what a user writes after
``--input`` and what a plan file stores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partita.core.errors import MAX_COUNT, InputSpecError, too_large

if TYPE_CHECKING:  # a spec is checked without torch (the plan's checks); its dtype is made with it
    import torch

_FORM = "NAME=DTYPE[SHAPE], e.g. idx=int64[8,128] or x=float32[4,3,32,32]"

# Accepted spellings -> torch's name of the dtype (the canonical one, used by __str__).
_DTYPES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "int64": "int64", "long": "int64",
    "int32": "int32", "int": "int32",
    "int16": "int16", "short": "int16",
    "int8": "int8", "uint8": "uint8",
    "bool": "bool",
}

_SPEC = re.compile(r"^\s*(?P<name>[^=\s]*)\s*=\s*(?P<dtype>[^\[\s]*)\s*(?P<shape>.*?)\s*$")


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own short name for ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def canonical_dtype(text: str) -> str:
    """torch's name of the dtype ``text`` names (its torch name or a common alias: ``bf16``, ``long``)."""
    try:
        return _DTYPES[text.strip().lower()]
    except KeyError:
        known = ", ".join(sorted(set(_DTYPES.values())))
        raise InputSpecError(
            f"unknown dtype {text!r}", hint=f"use one of {known} (or fp32, bf16, fp16, long)"
        ) from None


def parse_dtype(text: str) -> torch.dtype:
    """A dtype from its torch name or a common alias (``bf16``, ``long``, ...)."""
    import torch

    return getattr(torch, canonical_dtype(text))


@dataclass(frozen=True)
class InputSpec:
    """One positional model input: its name, dtype and full shape (batch first)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_name_and_shape(self.name, self.shape)

    def __str__(self) -> str:
        return f"{self.name}={dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def is_integer(self) -> bool:
        return not self.dtype.is_floating_point and not self.dtype.is_complex and dtype_name(self.dtype) != "bool"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InputSpec:
        try:
            return cls(str(data["name"]), parse_dtype(str(data["dtype"])), tuple(int(d) for d in data["shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputSpecError(f"malformed input spec {data!r}: {e}",
                                 hint='expected {"name": ..., "dtype": ..., "shape": [...]}') from e


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``NAME=DTYPE[SHAPE]``; raise ``InputSpecError`` naming what is wrong."""
    name, dtype, dims = check_input_spec(text)
    return InputSpec(name, parse_dtype(dtype), dims)


def check_input_spec(text: str) -> tuple[str, str, tuple[int, ...]]:
    """``NAME=DTYPE[SHAPE]`` checked without torch: its name, torch's name of its dtype and its
    shape; ``InputSpecError`` naming what is wrong."""
    m = _SPEC.match(text)
    if m is None or "=" not in text:
        raise InputSpecError(f"malformed input {text!r}: missing '='", hint=f"write {_FORM}")
    name, dtype_text, shape_text = m["name"], m["dtype"], m["shape"]
    if not name:
        raise InputSpecError(f"malformed input {text!r}: missing the name before '='", hint=f"write {_FORM}")
    if not dtype_text:
        raise InputSpecError(f"malformed input {text!r}: missing the dtype after '='", hint=f"write {_FORM}")
    if not (shape_text.startswith("[") and shape_text.endswith("]")):
        raise InputSpecError(
            f"malformed input {text!r}: the shape must follow the dtype in square brackets", hint=f"write {_FORM}"
        )
    dims = [d.strip() for d in shape_text[1:-1].split(",")]
    if dims == [""]:
        raise InputSpecError(f"malformed input {text!r}: empty shape", hint=f"write {_FORM}")
    bad = [d for d in dims if not (d.isascii() and d.isdigit())]
    if bad:
        raise InputSpecError(
            f"malformed input {text!r}: dims must be positive integers, got {', '.join(map(repr, bad))}",
            hint=f"write {_FORM}",
        )
    try:
        dtype = canonical_dtype(dtype_text)
    except InputSpecError as e:
        raise InputSpecError(f"malformed input {text!r}: {e.message}", hint=f"{e.hint}; write {_FORM}") from None
    shape = tuple(int(d) for d in dims)
    _check_name_and_shape(name, shape)
    return name, dtype, shape


def _check_name_and_shape(name: str, shape: tuple[int, ...]) -> None:
    if not name.isidentifier():
        raise InputSpecError(f"input name {name!r} is not an identifier", hint=f"write {_FORM}")
    if any(not isinstance(d, int) or d <= 0 for d in shape):
        raise InputSpecError(f"input {name!r}: every dim must be a positive integer, got {list(shape)}",
                             hint=f"write {_FORM}")
    if any(d > MAX_COUNT for d in shape):
        e = too_large(f"input {name!r}: dim", max(shape))
        raise InputSpecError(e.message, hint=e.hint)
