"""Bytes that autograd saves for backward, per node, measured by running the graph.

``annotate_saved_activations`` replays ``captured.graph_module`` under a fresh
``FakeTensorMode`` (no real memory) with every parameter requiring grad, and
records each tensor autograd saves through
``torch.autograd.graph.saved_tensors_hooks``. What is saved is whatever the
ATen kernels' autograd formulas save, not a hand-written rule.

Reads: ``kind`` and ``depends_on_input`` on the DiGraph's nodes (from
``to_networkx``) and the placeholders' ``meta["val"]`` (shapes, dtypes, strides).
Writes: ``saved_bytes`` on every node (bytes of tensors first saved while that
node ran), ``G.graph["saved_bytes_batch"]`` (saved tensors produced by nodes
that depend on a model input: they scale with the batch) and
``G.graph["saved_bytes_fixed"]`` (the rest, e.g. a causal mask built from
``arange``). A storage saved twice (a tensor and its view, or by two nodes)
counts once, for the first node. Parameters and buffers are left out: they are
model state, counted elsewhere.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from partita.compiler.capture import CapturedModel
from partita.passes.graph import tensor_values


class _SavedTensorRecorder(torch.fx.Interpreter):
    """Runs the graph and attributes each tensor saved for backward to the node running."""

    def __init__(self, gm: torch.fx.GraphModule, G: nx.DiGraph) -> None:
        # Every value stays alive until the end, so no storage address is reused while keys are held.
        super().__init__(gm, garbage_collect_values=False)
        self.G = G
        self.current: str | None = None
        self.excluded: set[int] = set()  # storages of parameters and buffers
        self.producer: dict[int, str] = {}  # storage -> first node whose output holds it
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []
        self.saved: dict[str, int] = {}
        self.batch_bytes = 0
        self.fixed_bytes = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n.name
        out = super().run_node(n)
        for t in tensor_values(out):
            self.producer.setdefault(_storage_key(t), n.name)
        if self.G.nodes[n.name]["kind"] in ("param", "buffer"):
            self.excluded.update(_storage_key(t) for t in tensor_values(out))
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in self.excluded or key in self.seen or self.current is None:
            return t
        self.seen.add(key)
        self.kept.append(t)
        nbytes = t.untyped_storage().nbytes()
        self.saved[self.current] = self.saved.get(self.current, 0) + nbytes
        # A tensor created inside this node (an op's internal mean/rstd, a mask) belongs to it.
        origin = self.producer.get(key, self.current)
        if self.G.nodes[origin]["depends_on_input"]:
            self.batch_bytes += nbytes
        else:
            self.fixed_bytes += nbytes
        return t


def annotate_saved_activations(G: nx.DiGraph, captured: CapturedModel) -> nx.DiGraph:
    """Write ``saved_bytes`` per node and the batch/fixed totals (see the module docstring)."""
    gm = captured.graph_module
    recorder = _SavedTensorRecorder(gm, G)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        args = [_fake_like(node, G.nodes[node.name]["kind"]) for node in gm.graph.nodes if node.op == "placeholder"]
        with torch.enable_grad():
            recorder.run(*args)
    for name, attrs in G.nodes(data=True):
        attrs["saved_bytes"] = recorder.saved.get(name, 0)
    G.graph["saved_bytes_batch"] = recorder.batch_bytes
    G.graph["saved_bytes_fixed"] = recorder.fixed_bytes
    return G


def _fake_like(node: torch.fx.Node, kind: str) -> torch.Tensor:
    val = node.meta["val"]
    t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)
    if kind == "param" and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
