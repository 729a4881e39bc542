"""Parameter loading: pretrained weights into the parameters this rank holds.

- ``open_weights``: a weights file as a mapping read lazily (a ``torch.save``d
  state dict memory-mapped, or a ``.safetensors`` file), so a rank reads only
  the tensors, and the slices of them, that it keeps;
- ``load_eager``: the whole file into the eager module, strictly (a missing or
  extra name is the user's to fix; a file that keeps one name of tied weights
  serves them all);
- ``load_local``: a tensor-parallel rank's shards (its slice of each
  parameter its nodes read, ``ParamDecision.layout["tp"]`` / the placeholder's
  ``NodeDecision.out``) and buffers, from the file or from the module's own
  tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from partita.core.errors import PartitaError, PlanError
from partita.core.model.capture import CapturedModel
from partita.core.placement import shard_dim
from partita.core.plans.plan import NodeDecision, Plan
from partita.runtime.experts import ExpertGroup
from partita.runtime.tp.collectives import TPGroup


class _SafetensorsFile(Mapping):
    """A .safetensors file as a read-only mapping, each tensor read when asked for."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self._file = safe_open(path, framework="pt")
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def open_weights(path: Any) -> Mapping[str, torch.Tensor]:
    """Pretrained weights as a mapping read lazily: a ``torch.save``d state dict (memory-mapped: a
    rank touches only the pages of the tensors and slices it takes) or a ``.safetensors`` file
    (a rank reads only the tensors its stage holds)."""
    path = Path(path)
    if not path.is_file():
        raise PartitaError(f"weights file {path} does not exist",
                           hint="pass weights= the path of a torch.save'd state dict or a .safetensors file")
    try:
        if path.suffix == ".safetensors":
            return _SafetensorsFile(str(path))
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:
        raise PartitaError(f"cannot read weights from {path}: {e}",
                           hint="pass a state dict saved with torch.save, or a .safetensors file") from e
    if not isinstance(state, Mapping):
        raise PartitaError(f"{path} holds a {type(state).__name__}, not a state dict of tensors",
                           hint="save the model's state_dict() (name -> tensor), not the module or a wrapper")
    return state


def state_names(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names in ``module.state_dict()`` (tied weights)."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(first.setdefault(id(p), name), []).append(name)
    return names


def load_eager(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Pretrained ``weights`` into the eager module, strictly: a missing or extra name is the
    user's to fix."""
    weights = dict(weights)
    for names in state_names(module).values():  # a file that keeps one name of tied weights
        have = next((n for n in names if n in weights), None)
        for n in names:
            if have is not None and n not in weights:
                weights[n] = weights[have]
    try:  # copied into the parameters (tied ones stay one); assigned only onto a meta-device model
        module.load_state_dict(weights, assign=any(p.is_meta for p in module.parameters()), strict=True)
    except RuntimeError as e:
        raise PartitaError(f"the weights do not fit this model: {str(e).splitlines()[0]} {str(e).splitlines()[1:2]}",
                           hint="pass the state dict of this model (its names as in model.state_dict())") from e


def _weight(state: Mapping[str, torch.Tensor], qualified: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
    """``qualified``'s tensor in a weights file, under any of its tied names (safetensors keeps one)."""
    names = [qualified] + [n for n, p in params.items() if p is params[qualified] and n != qualified]
    for name in names:
        if name in state:
            return state[name]
    raise PlanError(f"the weights file has no {' or '.join(names)}",
                    hint="pass the state dict of this model (its names as in model.state_dict())")


@dataclass
class LocalWeights:
    """What a tensor-parallel rank holds: its parameter shards and buffers, by placeholder."""

    shards: dict[str, nn.Parameter] = field(default_factory=dict)  # "a/b/weight" -> this rank's shard
    placements: dict[str, str] = field(default_factory=dict)  # qualified parameter name -> tp placement
    param_by_node: dict[str, str] = field(default_factory=dict)  # placeholder -> key in ``shards``
    buffers: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)  # placeholder -> (name, value)


def _placement(decisions: Mapping[str, NodeDecision], node: str) -> str:
    """Where a parameter lives: its placeholder's placement (core/plans/verify.py ``check_layouts``
    checked that the plan's parameter layout says the same)."""
    return decisions[node].out[0]


def load_local(module: nn.Module, captured: CapturedModel, plan: Plan, state: Mapping[str, torch.Tensor] | None,
               *, held: set[str], tp: TPGroup, device: torch.device,
               experts: tuple[ExpertGroup, set[str]] | None = None) -> LocalWeights:
    """This rank's slice of each parameter placeholder in ``held`` and each held buffer, from
    ``state`` (a weights file) when given, else from ``module``'s tensors. ``experts``: the expert
    group and the parameters stacked over experts, of which this rank keeps its own experts."""
    out = LocalWeights()
    decisions = {d.name: d for d in plan.nodes}
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    used = {n.name for n in captured.graph_module.graph.nodes if n.users}
    # a tied parameter can have several placeholders; the used ones say where it lives
    order = sorted(captured.param_nodes.items(), key=lambda kv: kv[0] not in used)
    for node, qualified in order:
        if node not in held:
            continue
        key = qualified.replace(".", "/")
        out.param_by_node[node] = key
        if key in out.shards:
            if node in used and _placement(decisions, node) != out.placements[qualified]:
                raise PlanError(f"tied parameter {qualified} has placeholders with different "
                                f"placements ({node}: {decisions[node].out[0]}, "
                                f"another: {out.placements[qualified]})",
                                hint="recompile the plan for this model with `partita compile`")
            continue
        placement = _placement(decisions, node)
        full = params[qualified] if state is None else _weight(state, qualified, params)
        d = shard_dim(placement)
        piece = full.detach() if d is None else full.detach().chunk(tp.size, dim=d)[tp.rank]
        if experts is not None and qualified in experts[1]:
            piece = piece[experts[0].experts(piece.shape[0])]
        out.shards[key] = nn.Parameter(piece.to(device, copy=True).contiguous(),
                                       requires_grad=params[qualified].requires_grad)
        out.placements[qualified] = placement
    for node, qualified in captured.buffer_nodes.items():
        if node not in held:
            continue
        value = state.get(qualified) if state is not None else None
        if value is None:
            value = buffers.get(qualified)
        if value is None:
            value = captured.constants.get(qualified)
        if value is None or value.device.type == "meta" or isinstance(value, FakeTensor):
            raise PlanError(f"buffer {qualified} has no value: it is not in the checkpoint and the "
                            f"module holds no real tensor for it",
                            hint="save it in the checkpoint or build the module with real buffers")
        out.buffers[node] = (qualified, value.detach().to(device, copy=True))
    return out
