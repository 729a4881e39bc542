"""Offload: the optimizer's state and the masters it updates kept in host memory (core/optimizers.py)."""

from __future__ import annotations

from partita.core.axes.rules import Axis, Rule
from partita.core.optimizers import NO_OFFLOAD, OFFLOAD_OPTIMIZER

IN_INFERENCE = Rule(
    ("offload", "inference"), lambda v: v["offload"] != NO_OFFLOAD and v["inference"],
    lambda say, v: f"{say('offload')} with {say('inference')}: an inference plan has no optimizer state to offload",
    "drop --offload")
NO_HOST = Rule(
    ("offload", "host_bandwidth"), lambda v: v["offload"] == OFFLOAD_OPTIMIZER and not v["host_bandwidth"],
    lambda say, v: f"{say('offload')}: the cluster gives no host bandwidth to price it by",
    "set host_gb_per_s and host_memory_gb_per_s in the cluster file, or use a preset")

AXIS = Axis("offload", ("offload",), (IN_INFERENCE, NO_HOST), describe=lambda plan: (
    "the optimizer's state and masters in host memory" if plan.training.offload == OFFLOAD_OPTIMIZER else None))
