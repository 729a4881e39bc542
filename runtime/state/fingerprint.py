"""What a checkpoint is of, and the first way it differs from what would load it.

A checkpoint's completion marker (runtime/state/marker.py) records its fingerprint: every tensor
of the model's state dict (its name, whole shape and dtype, in the model's order) and the
optimizer (its class and each param group's hyperparameters). ``load`` (runtime/state/loading.py)
compares them with the model and optimizer it loads into, before anything is read, and refuses
the first difference: a checkpoint of another model, or of another optimizer, never loads
silently. Loading a subset (``partial=True``) or into another optimizer (``optimizer="skip"`` or
``"state"``) happens only when asked.

A learning rate a scheduler changed is compared by its ``initial_lr`` (the lr the optimizer was
built with), so a run resumed with its scheduler is the same run. The LR scheduler's class and
state_dict are recorded too; restoring refuses a checkpoint whose schedule this run lacks or
runs with another class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# the hyperparameters compared and restored (those the optimizers partita plans for have)
HYPER = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "maximize",
         "amsgrad")
OPTIMIZER_MODES = ("restore", "state", "skip")  # load_checkpoint(optimizer=...)

Entry = list  # [shape (list of ints), dtype name]


@dataclass(frozen=True)
class Difference:
    """The first way a checkpoint differs from what would load it, as a message and a hint."""

    message: str
    hint: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_entries(tensors: Mapping[str, Any]) -> dict[str, Entry]:
    """name -> [whole shape, dtype] of each tensor (a tensor or a block list of the whole one)."""
    return {name: [list(t.shape), dtype_name(t.dtype)] for name, t in tensors.items()}


def merged(parts: Iterable[Mapping[str, Entry]], order: Iterable[str] = ()) -> dict[str, Entry]:
    """Several ranks' entries as one, in ``order`` where it names them, then as first seen."""
    seen: dict[str, Entry] = {}
    for part in parts:
        for name, entry in part.items():
            seen.setdefault(name, entry)
    head = {n: seen[n] for n in order if n in seen}
    return {**head, **{n: e for n, e in seen.items() if n not in head}}


def optimizer_entry(optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
    """The optimizer's class and each param group's hyperparameters, as plain JSON values."""
    if optimizer is None:
        return None
    return {"kind": type(optimizer).__name__,
            "param_groups": [{k: _plain(g[k]) for k in HYPER if k in g} for g in optimizer.param_groups]}


def scheduler_entry(scheduler: Any) -> dict[str, Any] | None:
    """The LR scheduler's class and its state_dict (None without one)."""
    return None if scheduler is None else {"kind": type(scheduler).__name__, "state": scheduler.state_dict()}


def scheduler_difference(saved: Mapping[str, Any] | None, scheduler: Any, mode: str) -> Difference | None:
    """With ``mode`` "restore": a checkpoint's schedule that this run lacks, or runs with another
    class (a checkpoint without one loads into a run with one, which then starts its schedule)."""
    here = type(scheduler).__name__ if scheduler is not None else None
    if mode != "restore" or saved is None or saved["kind"] == here:
        return None
    this = f"this run's is {here}" if here else "this run has none"
    return Difference(f"it was saved with a {saved['kind']} LR scheduler, and {this}",
                      f"pass scheduler= building a {saved['kind']} as it was saved, or load_checkpoint(..., "
                      "optimizer='state') to keep this run's hyperparameters and schedule")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _shown(entry: Entry) -> str:
    return f"{entry[1]}[{', '.join(map(str, entry[0]))}]"


def model_difference(saved: Mapping[str, Entry], here: Mapping[str, Entry], *, partial: bool) -> Difference | None:
    """The first difference between the checkpoint's tensors and this model's (in this model's
    order, then the checkpoint's); with ``partial`` only the tensors both hold must agree."""
    problems: list[str] = []
    for name, entry in here.items():
        if name not in saved:
            if not partial:
                problems.append(f"this model's {name} ({_shown(entry)}) is not in the checkpoint")
        elif list(saved[name]) != list(entry):
            problems.append(f"{name} is {_shown(saved[name])} in the checkpoint but {_shown(entry)} in this model")
    if not partial:
        problems += [f"the checkpoint holds {name} ({_shown(e)}), which this model lacks"
                     for name, e in saved.items() if name not in here]
    if partial and not set(saved) & set(here):
        problems.append("it shares no tensor with this model")
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more difference{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    return Difference(f"it is of another model: {problems[0]}{more}",
                      "load a checkpoint of this model (the same layers, names, shapes and dtypes), or pass "
                      "partial=True to load only the tensors both hold, each of the same shape and dtype")


def optimizer_difference(saved: Mapping[str, Any] | None, here: Mapping[str, Any] | None,
                         mode: str) -> Difference | None:
    """The first difference between the checkpoint's optimizer and this one, as ``mode`` asks:
    "restore" (the same class and hyperparameters; both restored), "state" (the same class; its
    state restored, this run's hyperparameters kept) or "skip" (the optimizer left as it is)."""
    if mode == "skip" or here is None:
        return None
    skip = "load_checkpoint(..., optimizer='skip') loads the model only and leaves this optimizer as it is"
    if saved is None:
        return Difference("it holds no optimizer state", f"{skip}")
    if saved["kind"] != here["kind"]:
        return Difference(f"it was saved with a {saved['kind']} optimizer, and this model's is {here['kind']}",
                          f"train with the optimizer it was saved with, or {skip}")
    if mode == "state":
        return None
    groups_saved, groups_here = saved["param_groups"], here["param_groups"]
    if len(groups_saved) != len(groups_here):
        return Difference(f"its {saved['kind']} has {len(groups_saved)} param group(s), this one {len(groups_here)}",
                          f"build the optimizer as it was saved, or {skip}")
    keep = ("load_checkpoint(..., optimizer='state') loads its optimizer state and keeps this run's "
            "hyperparameters")
    for i, (a, b) in enumerate(zip(groups_saved, groups_here)):
        for key in HYPER[:1] + HYPER[2:]:  # the lr by the one it started from (module docstring)
            x, y = (a.get(key), b.get(key)) if key != "lr" else (a.get("initial_lr", a.get("lr")),
                                                                 b.get("initial_lr", b.get("lr")))
            if x != y:
                group = f" (param group {i})" if len(groups_here) > 1 else ""
                return Difference(f"its {saved['kind']} has {key}={x!r}{group}, this one {key}={y!r}",
                                  f"build the optimizer with the hyperparameters it was saved with, or {keep}")
    return None
