"""The optimizers partita models (core/plans/plan.py ``OPTIMIZERS``): the default one a rank builds, the
cost model's name for what a user's factory builds, and where the optimizer's state may live."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from partita.core.errors import PartitaError

# Where the optimizer's state lives: "none", on the device; "optimizer", on the host, with the
# masters it updates (ZeRO-Offload's split: the step runs on the host CPU, gradients go down to
# it and updated parameters come back up each step; passes/cost_model.py ``offload_step_time``)
NO_OFFLOAD, OFFLOAD_OPTIMIZER = "none", "optimizer"
OFFLOAD = (NO_OFFLOAD, OFFLOAD_OPTIMIZER)


def default_optimizer(params: Iterable[Any], kind: str = "adamw") -> Any:
    """The optimizer ``kind`` at lr 1e-3 (SGD with momentum 0.9): AdamW fused where torch has a
    fused kernel for the parameters' device (CPU and CUDA do), one pass over the optimizer
    state as the cost model prices the step (passes/cost_model.py ``optimizer_time``), where the
    foreach step makes several (on this machine 2.6 ms against 17.8 ms for 3.7M fp32 parameters)."""
    import torch

    params = list(params)
    if kind in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if kind == "sgd-momentum" else 0.0)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    try:
        return cls(params, lr=1e-3, fused=True)
    except RuntimeError:  # a device or dtype torch has no fused kernel for
        return cls(params, lr=1e-3)


def optimizer_kind(factory: Callable) -> str:
    """The cost model's name for what ``factory`` builds (probed on a one-element parameter)."""
    import torch

    try:
        probe = factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception as e:  # the user's factory failed: say so, naming it
        raise PartitaError(f"the optimizer factory failed on a test parameter: {type(e).__name__}: {e}",
                           hint="pass optimizer=lambda params: torch.optim.AdamW(params, lr=...)") from e
    if isinstance(probe, torch.optim.AdamW):
        return "adamw"
    if isinstance(probe, torch.optim.Adam):
        return "adam"
    if isinstance(probe, torch.optim.SGD):
        return "sgd-momentum" if probe.defaults.get("momentum", 0) else "sgd"
    raise PartitaError(f"optimizer {type(probe).__name__} has no memory model yet",
                       hint="use torch.optim.AdamW, Adam or SGD")
