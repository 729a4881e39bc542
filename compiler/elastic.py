"""Re-planning an elastic run (`partita run --nnodes MIN:MAX`) for the processes it has now.

When a node is lost and the restarts at the old size are exhausted, torchrun's agent restarts
the survivors at a smaller world size (runtime/processes/agent.py; a node that comes back joins at the
next checkpoint). The plan `partita run` was given is then for another world size: rank 0
plans the model again for this one (``replan``: the plan search again, bounded by
``REPLAN_LIMIT_S``), keeping what the run is (its inputs, global batch, precision, optimizer
and loss), and the run resumes from its newest checkpoint, which DCP reshards into the new plan
(runtime/state/loading.py). So after the re-plan the run goes on exactly as a fresh resume into
that plan would.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch

from partita.core.errors import PartitaError, PlanError
from partita.core.options import Options
from partita.core.plans.plan import Plan

ELASTIC_ENV = "PARTITA_ELASTIC"  # set by `partita run --nnodes MIN:MAX` for its workers
REPLAN_LIMIT_S = 120.0  # the plan search's bound: past it the run ends with one message


def elastic() -> bool:
    return os.environ.get(ELASTIC_ENV) == "1"


def replan(module: torch.nn.Module, plan: Plan, options: Options, world_size: int, *,
           limit_s: float = REPLAN_LIMIT_S) -> Plan:
    """The plan for ``world_size`` processes of the run ``plan`` was made for (module docstring)."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import ClusterSpec

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cluster = ClusterSpec.from_dict(plan.cluster).with_devices(per_node).with_nodes(max(1, world_size // per_node))
    t = plan.training
    again = options.replace(plan=None, inputs=plan.model.inputs, targets=plan.model.targets, batch=t.global_batch,
                            precision=t.precision, reduce_dtype=t.reduce_dtype, max_grad_norm=t.max_grad_norm,
                            cluster=cluster, nodes=None, devices=None, world_size=world_size, dp=None, tp=None,
                            pp=None, zero=None, micro_batch_size=None, grad_accum_steps=None, schedule=None,
                            recompute=None)
    print(f"partita: the run has {world_size} process(es), its plan is for {plan.world_size}: planning again "
          f"(at most {limit_s:g} s)", file=sys.stderr, flush=True)
    found: dict[str, Any] = {}

    def search() -> None:
        try:
            found["plan"] = compile_model(module, again).plan
        except BaseException as e:  # raised below, on the caller's thread
            found["error"] = e

    thread = threading.Thread(target=search, name="partita-replan", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise PartitaError(f"planning again for {world_size} process(es) took longer than {limit_s:g} s",
                           hint="restart the run with the nodes it was planned for, or compile a plan for "
                           f"{world_size} process(es) and run that")
    if "error" in found:
        raise found["error"]
    new = found["plan"]
    if new.model.fingerprint != plan.model.fingerprint:
        raise PlanError(f"the script's model is not the one the run's plan was made for (fingerprint "
                        f"{new.model.fingerprint}, the plan's {plan.model.fingerprint})",
                        hint="run the script the plan was compiled from")
    print(f"partita: re-planned for {world_size} process(es): {new.mesh}, ZeRO-{new.training.zero_stage}",
          file=sys.stderr, flush=True)
    return new
