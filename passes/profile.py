"""A model's profile: the analyses run in order, summed into one frozen record.

``profile_model`` builds the DiGraph (``to_networkx``), then annotates FLOPs
(``annotate_flops``), saved activations (``annotate_saved_activations``) and
repeated layers (``find_repeated_layers``) and their attention cores (``attention_core``, what
selective recomputation reruns: core/recompute.py), records the mixture-of-experts layers
(``G.graph["experts"]``: core/experts.py's ``ExpertRegion``s, what expert parallelism splits,
passes/experts.py), and fingerprints the graph. The order matters only in that every pass
reads the attributes ``to_networkx`` writes; the annotated graph stays on the profile for the
solvers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from partita.core.experts import expert_regions
from partita.core.model.capture import CapturedModel
from partita.core.model.graph import graph_fingerprint, to_networkx
from partita.core.model.inputs import dtype_name
from partita.core.recompute import attention_cores
from partita.passes.activations import (
    annotate_kv_cache,
    annotate_live_bytes,
    annotate_saved_activations,
    peak_live_bytes,
)
from partita.passes.flops import annotate_flops
from partita.passes.repeats import RepeatedBlock, find_repeated_layers


@dataclass(frozen=True)
class ModelProfile:
    """What the planner needs to know about a model, at the captured batch size.

    ``flops_*`` and ``saved_bytes_*`` are for the captured inputs; use
    ``activation_bytes(micro_batch)`` for another micro-batch. ``param_dtype`` is
    the most common parameter dtype (by bytes).
    """

    name: str
    capture_method: str
    num_params: int
    param_bytes: int
    param_dtype: str
    num_nodes: int
    batch_size: int
    seq_len: int | None
    flops_fwd: int
    flops_bwd: int
    saved_bytes_batch: int
    saved_bytes_fixed: int
    repeated: tuple[RepeatedBlock, ...]
    fingerprint: str
    capture_seconds: float
    analysis_seconds: float
    graph: nx.DiGraph = field(compare=False, repr=False)

    def activation_bytes(self, micro_batch: int) -> int:
        """Saved-for-backward bytes of one micro-batch of ``micro_batch`` samples."""
        if micro_batch <= 0:
            raise ValueError(f"micro_batch must be positive, got {micro_batch}")
        return self.saved_bytes_batch * micro_batch // self.batch_size + self.saved_bytes_fixed

    def live_bytes(self, micro_batch: int) -> int:
        """The forward's largest live set of activations at ``micro_batch`` samples (logits included):
        what an inference step holds besides the weights (activations.annotate_live_bytes)."""
        return peak_live_bytes(self.graph, self.graph.nodes, micro_batch, self.batch_size)

    def kv_cache_bytes(self, micro_batch: int, tokens: int) -> int:
        """The keys and values a generation cache holds for ``micro_batch`` sequences of ``tokens``
        (prompt + generated), at the captured dtype (activations.annotate_kv_cache): 2 x layers x
        KV heads x head dim x tokens x batch x element bytes for a decoder."""
        if not self.seq_len:
            return 0
        return self.graph.graph.get("kv_bytes", 0) * micro_batch * tokens // (self.batch_size * self.seq_len)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the graph is left out)."""
        return {
            "name": self.name, "capture_method": self.capture_method, "num_params": self.num_params,
            "param_bytes": self.param_bytes, "param_dtype": self.param_dtype, "num_nodes": self.num_nodes,
            "batch_size": self.batch_size, "seq_len": self.seq_len, "flops_fwd": self.flops_fwd,
            "flops_bwd": self.flops_bwd, "saved_bytes_batch": self.saved_bytes_batch,
            "saved_bytes_fixed": self.saved_bytes_fixed, "repeated": [b.to_dict() for b in self.repeated],
            "fingerprint": self.fingerprint, "capture_seconds": self.capture_seconds,
            "analysis_seconds": self.analysis_seconds,
        }


def profile_model(captured: CapturedModel) -> ModelProfile:
    """Run the analyses over ``captured`` and summarise them."""
    start = time.perf_counter()
    G = to_networkx(captured)
    annotate_flops(G)
    repeated = find_repeated_layers(G)
    annotate_saved_activations(G, captured, repeated)  # three layers of the largest block replayed
    annotate_live_bytes(G)
    annotate_kv_cache(G)
    layer_of = {n: a["layer"] for n, a in G.nodes(data=True) if a.get("layer")}
    for n, core in attention_cores(captured.graph_module.graph.nodes, layer_of,
                                   {*captured.param_nodes, *captured.buffer_nodes}).items():
        G.nodes[n]["attention_core"] = core  # what selective recomputation reruns (core/recompute.py)
    G.graph["experts"] = tuple(expert_regions(captured.graph_module.graph, captured.param_nodes))

    numels = {k: _numel(shape) for k, (shape, _) in captured.params.items()}
    bytes_by_dtype: dict[str, int] = {}
    for k, (_, dtype) in captured.params.items():
        bytes_by_dtype[dtype_name(dtype)] = bytes_by_dtype.get(dtype_name(dtype), 0) + numels[k] * dtype.itemsize
    first = captured.inputs[0] if captured.inputs else None
    return ModelProfile(
        name=captured.name,
        capture_method=captured.method,
        num_params=sum(numels.values()),
        param_bytes=sum(bytes_by_dtype.values()),
        param_dtype=max(bytes_by_dtype, key=bytes_by_dtype.get) if bytes_by_dtype else "",
        num_nodes=G.number_of_nodes(),
        batch_size=first.shape[0] if first else 1,
        seq_len=first.shape[1] if first and first.is_integer and len(first.shape) >= 2 else None,
        flops_fwd=G.graph["flops_fwd"],
        flops_bwd=G.graph["flops_bwd"],
        saved_bytes_batch=G.graph["saved_bytes_batch"],
        saved_bytes_fixed=G.graph["saved_bytes_fixed"],
        repeated=tuple(repeated),
        fingerprint=graph_fingerprint(G),
        capture_seconds=captured.seconds,
        analysis_seconds=time.perf_counter() - start,
        graph=G,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
