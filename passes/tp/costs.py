"""What one tensor-parallel strategy costs on one node: the one per-node TP cost.

The TP ILP's input (passes/tp/problem.py ``build_problem``) prices every strategy of every
node with it, and the pipeline search (passes/tp/layout_costs.py ``tp_node_costs``) prices
the chosen layout node by node with it, so a stage is cut by the numbers the
layout was chosen by.

Per micro-batch on one device of a TP group of t ranks, under a ``TPCosts``:

- compute: the node's forward / backward FLOPs times the strategy's compute
  fraction, at the micro-batch (``beta``: micro-batch / captured batch for nodes
  that depend on a model input, 1 otherwise); on a roofline cluster at least the
  bytes it moves (``bytes_fwd`` / ``bytes_bwd``) over the memory bandwidth;
- internal: the collectives the op runs itself (vocabulary-parallel softmax);
- reshards: the forward reshard of each input from its producer's placement to
  the strategy's, and the backward reshard of its gradient to the producer's
  gradient convention, of the whole tensor's bytes (``tensor_bytes``: floating
  tensors at the precision's element size, others at their own: int64 is 8);
- saved bytes: the node's saved activations (an inference step's KV cache) at
  the precision: what it saves of an input (``saved_input_bytes``) at that input's share under
  the strategy (1/t sharded, whole otherwise), the rest at the strategy's memory fraction.
  Under sequence parallelism an input the node regathers (core/tp/layout.py ``regathers``) is
  held as its producer placed it, and its backward runs that all-gather once more, overlapped
  with the node's backward products as Megatron-LM overlaps them (``reshard_s``).

Every time formula is passes/cost_model.py's; every collective runs on the TP
group's link.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import networkx as nx

from partita.core.cluster import ClusterSpec, Link
from partita.core.model.graph import per_graph
from partita.core.model.ops import base_op
from partita.core.placement import NONE, is_shard
from partita.core.precision import activation_scale, element_bytes
from partita.core.tp.layout import regathers, tensor_bytes
from partita.core.tp.vocabulary import Strategy, grad_convention, reshard_kind
from partita.passes.cost_model import (
    NODE_TIME_ATTRS,
    collective_time,
    node_compute_time,
    precision_factor,
    reshard_time,
)
from partita.passes.peak_memory import node_transient

# graph -> {node: node_key, (node, output, element bytes): tensor bytes} (graph.per_graph): a search prices
# the same nodes at every (t, micro-batch)
_PER_GRAPH: weakref.WeakKeyDictionary[nx.DiGraph, tuple[int, dict]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class TPCosts:
    """The per-node cost of TP strategies on graph ``G`` at one (t, micro-batch) and training set-up."""

    G: nx.DiGraph
    cluster: ClusterSpec
    t: int
    micro_batch: int
    captured_batch: int
    precision: str
    inference: bool = False
    kv_ratio: float = 0.0  # inference with generation: KV cache / keys and values read
    captured_dtype: str = ""  # the dtype the graph's floating tensors were captured in ("": its parameters')
    sequence_parallel: bool = False  # linears regather their sequence-split inputs (core/tp/layout.py)

    @cached_property
    def link(self) -> Link:
        return self.cluster.link_for_group(self.t)

    @cached_property
    def act_scale(self) -> float:
        """Precision bytes over captured bytes of a floating tensor (core/precision.py)."""
        return activation_scale(self.precision, self.captured_dtype or captured_float_dtype(self.G))

    @cached_property
    def _graph_cache(self) -> dict:
        return per_graph(_PER_GRAPH, self.G)

    def node_key(self, n: str) -> tuple:
        """Everything ``compute_s``, ``internal_s`` and ``saved_bytes`` read of node ``n``: two
        nodes with equal keys cost the same under the same strategy (a repeated layer's nodes at
        one position), so a caller may price one and reuse it."""
        keys = self._graph_cache
        if n not in keys:
            a = self.G.nodes[n]
            keys[n] = (*(a.get(k, 0) for k in NODE_TIME_ATTRS), bool(a.get("depends_on_input")),
                       a.get("saved_bytes", 0), tuple(a.get("saved_input_bytes", ())), a.get("kv_bytes", 0),
                       a.get("transient_bytes", 0), base_op(a.get("op", "")))
        return keys[n]

    def beta(self, n: str) -> float:
        """How node ``n``'s work and tensors scale from the captured batch to the micro-batch."""
        return self.micro_batch / self.captured_batch if self.G.nodes[n].get("depends_on_input") else 1.0

    def tensor_bytes(self, n: str, i: int) -> float:
        """Bytes of node ``n``'s ``i``-th output at the micro-batch (whole, not one rank's share)."""
        sizes, key = self._graph_cache, (n, i, element_bytes(self.precision))
        if key not in sizes:
            sizes[key] = tensor_bytes(self.G, n, i, key[2])
        return sizes[key] * self.beta(n)

    def compute_s(self, n: str, st: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of node ``n``'s local FLOPs under ``st``."""
        a, scale = self.G.nodes[n], self.beta(n) * st.compute_fraction
        return node_compute_time(a, self.cluster, self.precision, scale=scale, byte_scale=scale * self.act_scale,
                                 inference=self.inference)

    def internal_s(self, n: str, st: Strategy) -> float:
        """Seconds of the collectives ``st`` runs inside the op."""
        return sum(collective_time(kind, nbytes * self.beta(n), self.t, self.link) for kind, nbytes in st.internal)

    def reshard_s(self, have: str, st: Strategy, j: int, nbytes: float, op: str = "",
                  backward_s: float = 0.0) -> tuple[float, float] | None:
        """(forward, backward) seconds of input ``j`` of a node calling ``op`` under ``st`` whose
        producer's output is in placement ``have`` and ``nbytes`` big; None when either reshard has no
        collective. A regathered input's backward gathers it once more, beside the product for the
        input's gradient, and reduces that gradient beside the product for the weight's (each half of
        the node's ``backward_s``): only what outlasts them is charged (runtime/tp/local_ops.py)."""
        kf = reshard_kind(have, st.ins[j])
        kb = "none" if self.inference or st.grads[j] == NONE else reshard_kind(st.grads[j], grad_convention(have))
        if "invalid" in (kf, kb):
            return None
        fwd, back = reshard_time(kf, nbytes, self.t, self.link), reshard_time(kb, nbytes, self.t, self.link)
        if not self.inference and regathers(op, j, kf, self.sequence_parallel, st.grads):
            back = max(0.0, fwd - backward_s / 2) + max(0.0, back - backward_s / 2)
        return fwd, back

    def saved_bytes(self, n: str, st: Strategy, haves: Sequence[str] | None = None) -> float:
        """Bytes node ``n`` keeps for backward under ``st`` on one device (its KV cache when generating);
        fp32 where autocast keeps the op in fp32 (cost_model.precision_factor). ``haves``: its
        producers' placements of its inputs, where known (a regathered input is held as placed)."""
        a = self.G.nodes[n]
        scale = self.beta(n) * self.act_scale * precision_factor(a.get("op", ""), self.precision, self.cluster.device)
        if self.inference:
            return a.get("kv_bytes", 0) * self.kv_ratio * st.memory_fraction * scale
        inputs = a.get("saved_input_bytes") or ()
        held = (a.get("saved_bytes", 0) - sum(inputs)) * st.memory_fraction
        for j, nbytes in enumerate(inputs):
            if nbytes:
                placed = st.ins[j]
                if haves is not None and regathers(a["op"], j, reshard_kind(haves[j], placed), self.sequence_parallel,
                                                   st.grads):
                    placed = haves[j]
                held += nbytes * (1 / self.t if is_shard(placed) else 1.0)
        return held * scale

    def transient_bytes(self, n: str, st: Strategy) -> float:
        """Bytes node ``n`` holds beyond the saved activations while it runs, under ``st`` on one
        device (peak_memory.node_transient: a loss's fp32 gradients, at the strategy's share)."""
        return node_transient(self.G.nodes[n], beta=self.micro_batch / self.captured_batch, act_scale=self.act_scale,
                              precision=self.precision, device=self.cluster.device, fraction=st.memory_fraction)


def captured_float_dtype(G: nx.DiGraph) -> str:
    """The dtype of the graph's first floating parameter (what its analyses measured floating
    tensors in); "" when it has none."""
    for _, a in G.nodes(data=True):
        if a["kind"] == "param" and a["dtypes"] and a["dtypes"][0].startswith(("float", "bfloat")):
            return a["dtypes"][0]
    return ""
