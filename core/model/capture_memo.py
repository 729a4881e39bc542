"""Captures kept for reuse in one process: the same model, inputs and loss are captured once.

Off by default. A process that builds the same small models over and over (the test suite's
ranks, each running many plans of a handful of models) turns it on with ``memoize_captures()``;
``capture`` (core/model/capture.py) then returns the first ``CapturedModel`` of an equal key.

What makes two captures equal:
- the module's structure (a factory's model as built under fake tensors), never its values: each
  submodule's class and that class's forward as it is now (a test may patch it), training flag,
  hooks, plain attributes (numbers, strings, flags: what a forward branches on) and Hugging Face
  config; each parameter's and buffer's name, shape, dtype, device type and ``requires_grad``;
- the input and target specs, the loss object, the name and ``stack_traces``.

A ``CapturedModel`` holds no tensor of the model except ``constants`` (the tensor values export
lifted out of the forward, which do belong to the instance), so a capture with constants is never
kept: a reused capture carries nothing of the module it was made from. A capture that fails is
never kept either; every check it runs is run again for the next key.

Only small graphs are kept (``MAX_NODES``), and the ``MAX_KEPT`` most recent: a kept graph is
objects the garbage collector walks on every full collection, and planning a large model with
100,000 of them alive ran 15-30% slower (tests/unit/test_search.py: 79 s -> 91 s); the models
captured over and over are the small ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from partita.core.model.inputs import InputSpec

CapturedModel = Any  # core/model/capture.py's (which imports this module, so not the other way)

MAX_NODES = 2_000  # a GPT of 12 layers is about 1,000 graph nodes
MAX_KEPT = 64
_kept: dict[Hashable, CapturedModel] | None = None  # oldest first
_PLAIN = (int, float, str, bool, type(None))


def memoize_captures(on: bool = True) -> None:
    """Keep captures for reuse from now on (``on``), or drop every kept one and stop."""
    global _kept
    _kept = {} if on else None


def memoizing() -> bool:
    return _kept is not None


def kept(key: Hashable | None) -> CapturedModel | None:
    return _kept.get(key) if _kept is not None and key is not None else None


def keep(key: Hashable | None, captured: CapturedModel) -> None:
    if (_kept is None or key is None or captured.constants
            or len(captured.graph_module.graph.nodes) > MAX_NODES):
        return
    _kept[key] = captured
    while len(_kept) > MAX_KEPT:
        del _kept[next(iter(_kept))]


def capture_key(module: torch.nn.Module, inputs: Sequence[InputSpec], *, name: str | None, loss: Callable | None,
                targets: InputSpec | None, stack_traces: bool) -> Hashable | None:
    """The key ``module``'s capture is kept under; None (never kept) when memoizing is off."""
    if _kept is None:
        return None
    return _structure(module), tuple(map(repr, inputs)), loss, repr(targets), name, stack_traces


def _structure(module: torch.nn.Module) -> tuple:
    parts: list[tuple] = []
    for path, sub in module.named_modules(remove_duplicate=False):
        attrs = []
        for k, v in sorted(vars(sub).items()):
            if isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v)):
                attrs.append((k, repr(v)))
            elif hasattr(v, "to_dict") and callable(v.to_dict):  # a Hugging Face config
                attrs.append((k, json.dumps(v.to_dict(), sort_keys=True, default=repr)))
            elif k.endswith("_hooks") or k.endswith("_pre_hooks") or k == "forward":
                attrs.append((k, repr(v)))  # hooks and an instance-level forward change the graph
        tensors = tuple((k, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
                        for k, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None)
        parts.append((path, type(sub), getattr(type(sub), "forward", None), tuple(attrs), tensors))
    return tuple(parts)
