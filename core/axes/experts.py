"""Expert parallelism: each MoE layer's experts split over groups of ``ep`` data-parallel ranks, tokens
sent to their experts by all-to-alls (core/experts.py, passes/experts.py, runtime/experts.py)."""

from __future__ import annotations

from partita.core.axes.rules import Axis, Rule, carved_out_of_dp
from partita.core.experts import EP_RUNS, ep_conflicts
from partita.core.mesh import MeshAxis
from partita.core.optimizers import NO_OFFLOAD
from partita.core.placement import REPLICATE

DIVIDES_DP = carved_out_of_dp("ep", "expert groups", "an")
NO_EXPERTS = Rule(
    ("ep", "experts"), lambda v: v["ep"] > 1 and not v["experts"],
    lambda say, v: f"{say('ep')}: the model has no mixture-of-experts layer to split (grouped matmuls over "
                   "parameters stacked by expert, core/experts.py)",
    "drop --ep")


def _beside(setting: str, flag: str) -> Rule:
    """ep > 1 beside ``setting``, which ``ep_conflicts`` rules out (``EP_RUNS``)."""
    def broken(v) -> bool:
        on = {"inference": False, "tp": 1, "offload": False, "sequence_parallel": False}
        on[setting] = v[setting] != NO_OFFLOAD if setting == "offload" else v[setting]
        return v["ep"] > 1 and setting in ep_conflicts(**on)
    return Rule(("ep", setting), broken, lambda say, v: f"{say('ep')} with {say(setting)}: this version runs ep > 1 "
                f"{EP_RUNS}", f"drop {flag}, or drop --ep")


LOAD_WITHOUT_EXPERTS = Rule(
    ("expert_load", "experts"), lambda v: v["expert_load"] != 1 and not v["experts"],
    lambda say, v: f"{say('expert_load')}: the model has no mixture-of-experts layer whose routing it could weigh",
    "drop --expert-load")
LOAD_ABOVE_EP = Rule(
    ("expert_load", "ep"), lambda v: not 1 <= v["expert_load"] <= max(v["ep"], 1),
    lambda say, v: f"{say('expert_load')} with {say('ep')}: the slowest rank of an expert group runs 1 to ep times "
                   "the mean rows (at ep = 1 each rank runs every expert on its own rows: no imbalance)",
    "pin --expert-load between 1 and --ep, or drop one of them")


def _plan_checks(plan) -> list[str]:
    """An ep layout is an expert weight's: compile gives it to the parameters its grouped matmuls read
    and to no other (by module: a plan names no placeholder's parameter; check_layouts compares
    each with the graph's experts at run time)."""
    from partita.core.experts import decided_expert_modules

    modules = decided_expert_modules(plan.nodes)
    out = []
    for p in plan.params:
        placement = p.layout.get(MeshAxis.EP.value, REPLICATE)
        if placement != REPLICATE and p.name.rpartition(".")[0] not in modules:
            out.append(f"parameter {p.name}: ep layout {placement}, but it is no expert weight (no grouped matmul "
                       "over experts reads it, core/experts.py): only those are split over ep")
    return out


AXIS = Axis("expert parallelism", ("ep", "expert_load"),
            (DIVIDES_DP, NO_EXPERTS, _beside("tp", "--tp"), _beside("inference", "--inference"),
             _beside("offload", "--offload"), _beside("sequence_parallel", "--sequence-parallel"),
             LOAD_WITHOUT_EXPERTS, LOAD_ABOVE_EP), _plan_checks,
            lambda plan: (f"ep = {plan.mesh.ep}: each MoE layer's experts split over groups of {plan.mesh.ep} "
                          "data-parallel ranks" if plan.mesh.ep > 1 else None))
