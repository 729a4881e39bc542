"""What the graph and the cluster say of a model, for the axes' rules (core/axes): whether it has
attention cores (selective recomputation's), repeated layers (full recomputation's), a residual
stream (sequence parallelism's), mixture-of-experts layers (expert parallelism's), and whether the
cluster prices the host (offload's). Verify reads the same facts from a plan's decisions
(core/axes ``plan_facts``)."""

from __future__ import annotations

from typing import Any

from partita.core.axes import sequence_of
from partita.core.cluster import ClusterSpec
from partita.core.model.ops import ATTENTION, base_op
from partita.passes.experts import model_experts
from partita.passes.profile import ModelProfile
from partita.passes.tp.sequence import residual_nodes


def model_facts(profile: ModelProfile, cluster: ClusterSpec) -> dict[str, Any]:
    G = profile.graph
    return {"attention_core": any(a.get("attention_core") for _, a in G.nodes(data=True)),
            "repeated_layers": any(a.get("layer") for _, a in G.nodes(data=True)),
            "residual_stream": bool(residual_nodes(G)), "experts": bool(model_experts(G)),
            "host_bandwidth": cluster.host_bandwidth > 0 and cluster.host_memory_bandwidth > 0,
            "sequence": sequence_of(a["shapes"][0] for _, a in G.nodes(data=True)
                                   if a.get("kind") == "input" and a.get("shapes")), "heads": attention_heads(G)}


def attention_heads(G) -> int | None:
    """The heads every fused attention core splits (dim 1 of its query, batch x heads x sequence x
    dim: all-to-all context parallelism's unit), the fewest where they differ; None without one."""
    heads = [a["shapes"][0][1] for _, a in G.nodes(data=True)
             if base_op(a.get("op", "")) in ATTENTION and a.get("shapes") and len(a["shapes"][0]) == 4]
    return min(heads) if heads else None
