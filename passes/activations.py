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

``annotate_live_bytes`` is the forward-only counterpart: the activations alive while each
node runs (``live_batch`` / ``live_fixed``), whose peak is an inference step's memory.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from partita.core.capture import CapturedModel
from partita.core.ops import tensor_values


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


def annotate_live_bytes(G: nx.DiGraph) -> nx.DiGraph:
    """Write ``live_batch`` / ``live_fixed`` on every node: the bytes of activations alive while it
    runs in the forward (captured order), split as ``saved_bytes`` is into what grows with the batch
    and what does not. What a forward-only step needs on top of the model state is their largest
    sum (``peak_live_bytes``).

    A tensor is alive from the node producing it to its last reader, logits and outputs included
    (the output node reads them last). A view (an op whose schema says its output aliases an input,
    ``getitem`` of a tuple) adds no bytes and keeps the tensor it views alive. Parameters, buffers
    and their views are model state, counted elsewhere.
    """
    order = list(G.nodes)
    at = {n: i for i, n in enumerate(order)}
    root: dict[str, str] = {}
    for n in order:
        a = G.nodes[n]
        srcs = a.get("inputs", [])
        root[n] = root[srcs[0]] if srcs and _aliases(a["op"]) else n
    death = {n: at[n] for n in order}
    for n in order:
        for src in G.nodes[n].get("inputs", []):
            r = root[src]
            death[r] = max(death[r], at[n])
    grow = [0] * (len(order) + 1)
    fixed = [0] * (len(order) + 1)
    for n in order:
        a = G.nodes[n]
        if root[n] != n or a["kind"] not in ("call", "input"):
            continue
        acc = grow if a.get("depends_on_input") else fixed
        acc[at[n]] += a.get("out_bytes", 0)
        acc[death[n] + 1] -= a.get("out_bytes", 0)
    live_b = live_f = 0
    for i, n in enumerate(order):
        live_b += grow[i]
        live_f += fixed[i]
        G.nodes[n]["live_batch"], G.nodes[n]["live_fixed"] = live_b, live_f
    return G


def peak_live_bytes(G: nx.DiGraph, nodes: Any, micro_batch: int, batch: int, scale: float = 1.0) -> int:
    """The largest live set (``annotate_live_bytes``) over ``nodes`` at ``micro_batch`` samples of a
    graph captured at ``batch``, times ``scale`` (the precision's element size over the captured one)."""
    return round(max((G.nodes[n].get("live_batch", 0) * micro_batch / batch + G.nodes[n].get("live_fixed", 0)
                      for n in nodes), default=0) * scale)


def _aliases(op: str) -> bool:
    """Whether ``op``'s output is a view of its first input (its ATen schema's alias annotation)."""
    if op.endswith("getitem"):
        return True
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return False
    try:
        overload = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in overload._schema.returns)


_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
_REARRANGE = frozenset({"reshape", "clone", "contiguous", "_unsafe_view", "expand", "repeat", "repeat_interleave",
                        "_to_copy"})


def annotate_kv_cache(G: nx.DiGraph) -> int:
    """Write ``kv_bytes`` on every attention op and their sum ``G.graph["kv_bytes"]``: the keys and
    values it reads, at the captured batch and sequence, as a generation cache holds them (bytes,
    captured dtype); returns the sum. A planner scales them by the micro-batch and by
    ``TrainingRequest.kv_tokens`` over the captured sequence.

    Each attention op's key and value are followed back through ops that only rearrange or repeat
    them (views, reshapes, expands, copies), and the smallest tensor on that chain is what is cached:
    grouped-query attention repeats each KV head for its query heads after the cache, and rotary
    embeddings are applied before it (Hugging Face's order).
    """
    total = 0
    for _, a in G.nodes(data=True):
        if a["kind"] != "call" or not any(k in a["op"] for k in _ATTENTION) or len(a["inputs"]) < 3:
            continue
        for src in a["inputs"][1:3]:
            smallest = _tensor_bytes(G, src)
            while True:
                b = G.nodes[src]
                tensors = b.get("inputs", [])
                rearranges = b["op"].split(".")[1:2] and b["op"].split(".")[1] in _REARRANGE
                if len(tensors) != 1 or not (_aliases(b["op"]) or rearranges):
                    break
                src = tensors[0]
                smallest = min(smallest, _tensor_bytes(G, src))
            total += smallest
            a["kv_bytes"] = a.get("kv_bytes", 0) + smallest
    G.graph["kv_bytes"] = total
    return total


def _tensor_bytes(G: nx.DiGraph, n: str) -> int:
    return G.nodes[n].get("out_bytes", 0)
