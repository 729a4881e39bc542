"""Find the repeated layers of a model (the blocks of a ``ModuleList``).

``find_repeated_layers`` reads ``module``, ``op``, ``kind``, ``shapes``,
``dtypes`` and ``param_name`` on each node (from ``to_networkx``). A node belongs
to layer ``prefix.i`` when its module path is ``prefix.i`` or below it, with
``i`` the first integer component of the path (``transformer.h.3.attn`` ->
``transformer.h``, 3). Layers under one prefix whose node sequences have the
same signature (ops, shapes, dtypes, module and parameter paths relative to
the layer) form one ``RepeatedBlock``; solvers can then solve one layer and
reuse the answer. It writes ``layer`` (``"transformer.h.3"``) and
``layer_index`` (3) on the nodes of every layer found in a block.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass

import networkx as nx

_LAYER = re.compile(r"^(?P<prefix>(?:[^.]+\.)*?[^.]+)\.(?P<index>\d+)(?:\.|$)")


@dataclass(frozen=True)
class RepeatedBlock:
    """Layers ``prefix.i`` for ``i`` in ``indices``, all with the same structure."""

    prefix: str
    indices: list[int]
    module_type: str
    nodes_per_layer: int
    signature: str

    @property
    def layers(self) -> list[str]:
        return [f"{self.prefix}.{i}" for i in self.indices]

    def to_dict(self) -> dict:
        return {"prefix": self.prefix, "indices": list(self.indices), "module_type": self.module_type,
                "nodes_per_layer": self.nodes_per_layer, "signature": self.signature}


def find_repeated_layers(G: nx.DiGraph) -> list[RepeatedBlock]:
    """The repeated blocks of ``G``, largest first; labels their nodes with ``layer``/``layer_index``."""
    members: dict[tuple[str, int], list[str]] = defaultdict(list)
    for name, attrs in G.nodes(data=True):  # graph order: the order the layer ran in
        m = _LAYER.match(attrs.get("module", ""))
        if m:
            members[(m["prefix"], int(m["index"]))].append(name)

    by_signature: dict[tuple[str, str], list[int]] = defaultdict(list)
    for (prefix, index), names in sorted(members.items()):
        by_signature[(prefix, _signature(G, names, f"{prefix}.{index}"))].append(index)

    blocks = []
    for (prefix, signature), indices in by_signature.items():
        if len(indices) < 2:
            continue
        first = members[(prefix, indices[0])]
        blocks.append(RepeatedBlock(
            prefix=prefix,
            indices=indices,
            module_type=_layer_type(G, first, f"{prefix}.{indices[0]}"),
            nodes_per_layer=len(first),
            signature=signature,
        ))
        for i in indices:
            for name in members[(prefix, i)]:
                G.nodes[name]["layer"] = f"{prefix}.{i}"
                G.nodes[name]["layer_index"] = i
    blocks.sort(key=lambda b: (-len(b.indices) * b.nodes_per_layer, b.prefix))
    return blocks


def _signature(G: nx.DiGraph, names: list[str], layer: str) -> str:
    """Hash of the layer's node sequence with paths made relative to the layer."""
    position = {n: i for i, n in enumerate(names)}
    rows = []
    for n in names:
        a = G.nodes[n]
        rows.append([
            a["op"], a["kind"], [list(s) for s in a["shapes"]], a["dtypes"],
            _relative(a.get("module", ""), layer), _relative(a.get("param_name", ""), layer),
            # inputs from inside the layer by position, from outside by kind only
            [position.get(p, "outside") for p in a.get("inputs", [])],
        ])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _relative(path: str, layer: str) -> str:
    return path[len(layer):] if path.startswith(layer) else path


def _layer_type(G: nx.DiGraph, names: list[str], layer: str) -> str:
    """The class of the layer module itself (``Block``, ``LlamaDecoderLayer``), if any node ran in it."""
    for n in names:
        if G.nodes[n].get("module") == layer and G.nodes[n].get("module_type"):
            return G.nodes[n]["module_type"]
    return G.graph.get("module_types", {}).get(layer, "")
