"""Example-input specifications: ``NAME=DTYPE[SHAPE]``.

A model is captured against inputs described only by name, dtype and shape
(``idx=int64[8,128]``, ``x=float32[4, 3, 32, 32]``); no data is needed because
capture runs on fake tensors. The text form is what a user writes after
``--input`` and what a plan file stores.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from partita.core.errors import InputSpecError

_FORM = "NAME=DTYPE[SHAPE], e.g. idx=int64[8,128] or x=float32[4,3,32,32]"

# Accepted spellings -> dtype. The canonical name (used by __str__) is torch's.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64,
    "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "short": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}

_SPEC = re.compile(r"^\s*(?P<name>[^=\s]*)\s*=\s*(?P<dtype>[^\[\s]*)\s*(?P<shape>.*?)\s*$")


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own short name for ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(text: str) -> torch.dtype:
    """A dtype from its torch name or a common alias (``bf16``, ``long``, ...)."""
    try:
        return _DTYPES[text.strip().lower()]
    except KeyError:
        known = ", ".join(sorted({dtype_name(d) for d in _DTYPES.values()}))
        raise InputSpecError(
            f"unknown dtype {text!r}", hint=f"use one of {known} (or fp32, bf16, fp16, long)"
        ) from None


@dataclass(frozen=True)
class InputSpec:
    """One positional model input: its name, dtype and full shape (batch first)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise InputSpecError(f"input name {self.name!r} is not an identifier", hint=f"write {_FORM}")
        if any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise InputSpecError(
                f"input {self.name!r}: every dim must be a positive integer, got {list(self.shape)}",
                hint=f"write {_FORM}",
            )

    def __str__(self) -> str:
        return f"{self.name}={dtype_name(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def is_integer(self) -> bool:
        return not self.dtype.is_floating_point and not self.dtype.is_complex and self.dtype != torch.bool

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
    bad = [d for d in dims if not d.isdigit()]
    if bad:
        raise InputSpecError(
            f"malformed input {text!r}: dims must be positive integers, got {', '.join(map(repr, bad))}",
            hint=f"write {_FORM}",
        )
    try:
        dtype = parse_dtype(dtype_text)
    except InputSpecError as e:
        raise InputSpecError(f"malformed input {text!r}: {e.message}", hint=f"{e.hint}; write {_FORM}") from None
    return InputSpec(name, dtype, tuple(int(d) for d in dims))
