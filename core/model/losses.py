"""The training loss, attached to a model's output as users write models.

Models return a tensor, a Hugging Face ``ModelOutput``, a dict, a tuple or a
dataclass. ``OutputLoss`` picks the tensor the loss attaches to (``output``: a
field name or a tuple index; by default ``logits``, else the only or first
tensor) and applies the loss to it; ``MODEL_LOSS`` ("model") instead calls the
model with ``labels=targets`` and takes the loss it computes itself. Capture
(core/model/capture.py) and the eager runtime (runtime/engine.py) both go
through ``training_loss``, so the graph that is planned and the step that runs
compute the same thing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from partita.core.errors import PartitaError

LOGITS = "logits"
MODEL = "model"


def default_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; (B, T, V) logits against (B, T) targets are flattened."""
    if output.dim() > 2:
        return F.cross_entropy(output.flatten(0, -2), targets.flatten())
    return F.cross_entropy(output, targets)


def mse_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error (targets of the output's shape and dtype)."""
    return F.mse_loss(output, targets)


NAMED = {"cross-entropy": default_loss, "mse": mse_loss}


def _fields(out: Any) -> dict[str, Any]:
    if isinstance(out, Mapping):  # ModelOutput is an OrderedDict
        return dict(out.items())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return {}


def select_output(out: Any, output: str | int | None = None) -> torch.Tensor:
    """The tensor of ``out`` that the loss attaches to (module docstring)."""
    if isinstance(out, torch.Tensor) and output is None:
        return out
    fields = _fields(out)
    if isinstance(out, (tuple, list)) and not fields:
        tensors = [i for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
        if output is None and len(tensors) > 1:
            raise PartitaError(f"the model returns a {len(out)}-tuple holding {len(tensors)} tensors (elements "
                               f"{', '.join(map(str, tensors))}): which one does the loss attach to?",
                               hint="pass output=INDEX (or `--output-field INDEX`)")
        index = int(output) if output is not None else (tensors[0] if tensors else 0)
        if not -len(out) <= index < len(out):
            raise PartitaError(f"the model returns a {len(out)}-tuple; output={output!r} is not in it",
                               hint="pass output= an index of the tuple the model returns")
        return _tensor(out[index], f"element {index}")
    if fields:
        name = output if output is not None else (LOGITS if LOGITS in fields else None)
        if name is None:
            tensors = [k for k, v in fields.items() if isinstance(v, torch.Tensor)]
            if len(tensors) != 1:
                raise PartitaError(f"the model returns {type(out).__name__} with fields {', '.join(fields)} and no "
                                   f"`logits`: which one does the loss attach to?",
                                   hint="pass output='NAME' (or `--output NAME`)")
            name = tensors[0]
        if name not in fields:
            raise PartitaError(f"the model's {type(out).__name__} has no field {name!r} (it has {', '.join(fields)})",
                               hint="pass output= one of those")
        return _tensor(fields[name], f"field {name!r}")
    raise PartitaError(f"the model returns {type(out).__name__}, which holds no tensor to attach a loss to",
                       hint="return the logits (or a dict / ModelOutput / tuple holding them)")


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise PartitaError(f"the model output's {what} is {type(value).__name__}, not a tensor",
                           hint="pass output= naming a tensor field")
    return value


@dataclasses.dataclass(frozen=True)
class OutputLoss:
    """``loss(select_output(out, output), targets)``."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = default_loss
    output: str | int | None = None

    @property
    def __name__(self) -> str:
        name = getattr(self.loss, "__name__", type(self.loss).__name__)
        return name if self.output is None else f"{name}({self.output})"

    def __call__(self, out: Any, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(select_output(out, self.output), targets)

    def select(self, out: Any) -> torch.Tensor:
        return select_output(out, self.output)


@dataclasses.dataclass(frozen=True)
class ModelLoss:
    """The model's own loss: ``model(*inputs, labels=targets).loss``."""

    __name__ = "model"
    uses_labels = True

    def __call__(self, out: Any, targets: torch.Tensor) -> torch.Tensor:
        return model_loss_of(out)

    def select(self, out: Any) -> torch.Tensor:
        return select_output(out, None)


def model_loss_of(out: Any) -> torch.Tensor:
    """The loss a model computed from its ``labels`` (its ``loss`` field, or a tuple's first)."""
    fields = _fields(out)
    value = fields.get("loss") if fields else (out[0] if isinstance(out, (tuple, list)) and out else out)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise PartitaError("loss='model': the model returned no scalar `loss` when given labels=",
                           hint="pass a model that takes `labels` (e.g. a Hugging Face *ForCausalLM), or a loss "
                           "function")
    return value


def resolve_loss(loss: Any = None, output: str | int | None = None) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The loss object for ``loss`` (a callable, a name in ``NAMED``, "model", or None: cross-entropy)
    attached to ``output``."""
    if isinstance(loss, (OutputLoss, ModelLoss)) and output in (None, getattr(loss, "output", None)):
        return loss  # resolved already
    if isinstance(loss, OutputLoss):
        return OutputLoss(loss.loss, output)
    if loss == MODEL:
        if output is not None:
            raise PartitaError("loss='model' takes the model's own loss: output= does not apply",
                               hint="drop output= (the model's own loss is used), or pass another loss")
        return ModelLoss()
    if isinstance(loss, str):
        if loss not in NAMED:
            raise PartitaError(f"unknown loss {loss!r}", hint=f"use one of {', '.join(NAMED)}, 'model', or a function")
        loss = NAMED[loss]
    if loss is not None and not callable(loss):
        raise PartitaError(f"loss={loss!r} is neither a function nor a loss name",
                           hint="pass a function (output, targets) -> loss, 'cross-entropy', 'mse' or 'model'")
    return OutputLoss(loss or default_loss, output)


def training_loss(loss: Callable[[Any, torch.Tensor], torch.Tensor], forward: Callable[..., Any],
                  inputs: tuple[Any, ...] | list[Any], targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss: ``loss(forward(*inputs), targets)``, or the model's own from
    ``forward(*inputs, labels=targets)`` (``ModelLoss``)."""
    if getattr(loss, "uses_labels", False):
        return model_loss_of(forward(*inputs, labels=targets))
    return loss(forward(*inputs), targets)
