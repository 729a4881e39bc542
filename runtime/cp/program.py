"""What context parallelism changes in a rank's program (runtime/tp/program.py builds it).

The rank's training graph is captured at its own sequence slice (``mesh.cp`` x fewer tokens than
the plan's inputs, runtime/tp/module.py), so every op but attention already runs on its tokens.
``ContextParallel`` finds, on that graph, the two kinds of node that must see the whole sequence:

- each ``torch.arange`` over the slice's length (the sequence's positions: a learned position
  table's index, a rotary embedding's, a mask's) gives this rank's true positions
  (core/mesh.py ``sequence_positions``) in its place;
- each ``scaled_dot_product_attention`` runs over the cp group (runtime/cp/attention.py), causal
  or not as its mask says: ``is_causal``, or a mask computed from positions alone that is the
  causal one (or none) on a whole sequence. A mask it cannot split (one read from a model input,
  a padding or sliding-window mask), attention dropout, and attention written out as matmuls are
  refused before the first step, naming the module.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.fx

from partita.core.errors import PlanError
from partita.core.model.ops import ATTENTION
from partita.core.recompute import attention_cores
from partita.runtime.cp.attention import ContextGroup, attention

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


class Core(NamedTuple):
    """One attention call over the cp group: whether causal, and its scale."""

    g: ContextGroup
    strategy: str
    causal: bool
    scale: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return attention(q, k, v, self.g, self.strategy, self.causal, self.scale)


class ContextParallel:
    """The nodes of a rank's graph that context parallelism replaces, and what replaces each."""

    def __init__(self, g: ContextGroup, strategy: str, graph_module: torch.fx.GraphModule, *,
                 user_inputs: set[str], buffers: dict[str, torch.Tensor], module_of: dict[str, str],
                 layer_of: dict[str, str], micro_batch: int) -> None:
        self.g, self.strategy = g, strategy
        local = g.seq_len // g.size
        graph = graph_module.graph
        self.positions: dict[str, torch.dtype] = {}  # arange node -> its dtype
        self.cores: dict[str, Core] = {}
        attention_nodes = [n for n in graph.nodes if n.op == "call_function"
                           and getattr(n.target, "__name__", "").split(".")[0] in ATTENTION]
        for n in attention_nodes:
            self.cores[n.name] = self._core(n, graph_module, user_inputs, buffers, module_of.get(n.name, "") or n.name)
        masks = _ancestors([_mask_of(n) for n in attention_nodes if isinstance(_mask_of(n), torch.fx.Node)])
        for n in graph.nodes:
            # an arange over the slice is its positions where they reach more than a mask (which the
            # attention over "cp" replaces): a position table's index, a rotary angle; a mask's own
            # index over the slice stays as it was captured
            if n.op == "call_function" and n.target in _ARANGE and _spans(n) == local \
                    and _reaches_beyond(n, masks, set(attention_nodes)):
                if micro_batch == local:
                    raise PlanError(f"the micro-batch of {micro_batch} samples equals the {local} tokens each cp rank "
                                    "holds: partita cannot tell the sequence's positions (torch.arange) from the "
                                    "batch's", hint="compile with another --micro-batch-size or --cp")
                self.positions[n.name] = n.kwargs.get("dtype") or torch.int64
        if not self.cores:
            cores = attention_cores(graph.nodes, layer_of, {*buffers, *(p.name for p in graph.nodes
                                                                        if p.op == "placeholder" and p.name not in user_inputs)})
            where = sorted({module_of.get(name, name) for name in cores})
            raise PlanError("context parallelism runs attention written as scaled_dot_product_attention; "
                            + (f"{where[0]} writes it out (Q K^T, softmax, P V)" if where else
                               "this model calls none (its attention is written out as matmuls, or it has none)"),
                            hint="use F.scaled_dot_product_attention (HF: attn_implementation='sdpa'), or "
                            "recompile with --cp 1")

    def _core(self, n: torch.fx.Node, gm: torch.fx.GraphModule, user_inputs: set[str],
              buffers: dict[str, torch.Tensor], module: str) -> Core:
        if n.target is not _SDPA:
            raise PlanError(f"{module} calls {n.target}: context parallelism runs scaled_dot_product_attention",
                            hint="recompile with --cp 1")
        args = list(n.args) + [None] * (6 - len(n.args))
        mask = _mask_of(n)
        dropout = n.kwargs.get("dropout_p", args[4]) or 0.0
        causal = bool(n.kwargs.get("is_causal", args[5]))
        if dropout:
            raise PlanError(f"{module}'s attention drops probabilities (dropout_p={dropout}): context parallelism "
                            "does not split attention dropout", hint="set the attention dropout to 0, or --cp 1")
        if isinstance(mask, torch.fx.Node):
            causal = _mask_is_causal(mask, gm, user_inputs, buffers, module)
        q = n.args[0].meta["val"]
        scale = n.kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        if self.strategy == "all-to-all" and heads % self.g.size:
            raise PlanError(f"{module}: {heads} heads on this rank do not divide over cp={self.g.size} for "
                            "all-to-all attention", hint="recompile with --cp-attention ring")
        return Core(self.g, self.strategy, causal, float(scale))

    def replaces(self, name: str) -> bool:
        return name in self.positions or name in self.cores

    def emit(self, builder: Any, n: torch.fx.Node, args: list, kwargs: dict) -> torch.fx.Node:
        """The node that stands for ``n`` in the rank's program (``builder``: runtime/tp/program.py's)."""
        if n.name in self.positions:
            return builder.attr("positions", self.g.positions().to(self.positions[n.name]))
        from partita.runtime.tp.program import call

        return builder.graph.call_function(call, (builder.attr("cp_attention", self.cores[n.name]), *args[:3]))


def _mask_of(n: torch.fx.Node) -> Any:
    """The ``attn_mask`` argument of a scaled_dot_product_attention node (None without one)."""
    return n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)


def _ancestors(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """``nodes`` and every node they are computed from."""
    seen: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack += x.all_input_nodes
    return seen


def _reaches_beyond(n: torch.fx.Node, masks: set[torch.fx.Node], attention: set[torch.fx.Node]) -> bool:
    """Whether a node computed from ``n`` (not through an attention node) is outside ``masks``."""
    seen: set[torch.fx.Node] = set()
    stack = list(n.users)
    while stack:
        x = stack.pop()
        if x in seen or x in attention:
            continue
        seen.add(x)
        if x not in masks and (x.users or x.op == "output"):  # (a check of a mask, export's asserts, is none)
            return True
        stack += list(x.users)
    return False


def _spans(n: torch.fx.Node) -> int | None:
    """How many values an ``arange`` gives from 0 by 1 (None when it starts elsewhere or steps)."""
    args = list(n.args)
    if len(args) == 1:
        return int(args[0]) if isinstance(args[0], int) else None
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else 1
    return int(end) if start == 0 and step == 1 and isinstance(end, int) else None


def _mask_is_causal(mask: torch.fx.Node, gm: torch.fx.GraphModule, user_inputs: set[str],
                    buffers: dict[str, torch.Tensor], module: str) -> bool:
    """Whether the attention mask ``mask`` is the causal one (True) or lets every query see every
    key (False), evaluated on the captured slice as a whole sequence; refused when it reads a
    model input or parameter, or is another mask."""
    seen: dict[torch.fx.Node, None] = {}
    stack = [mask]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen[x] = None
        if x.op == "placeholder" and x.name not in buffers:
            what = "a model input" if x.name in user_inputs else "a parameter"
            raise PlanError(f"{module}'s attention mask reads {what} ({x.name}, a padding mask?): context "
                            "parallelism splits a mask computed from positions only",
                            hint="train on unpadded (packed) sequences without an attention mask, or --cp 1")
        stack += x.all_input_nodes
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}
    feeds = []
    for x in gm.graph.nodes:
        if x in seen:
            if x.op == "placeholder":
                env[x] = sub.placeholder(x.name)
                feeds.append(buffers[x.name].detach().cpu())
            else:
                env[x] = sub.node_copy(x, lambda a: env[a])
    sub.output(env[mask])
    with torch.no_grad():
        m = torch.fx.GraphModule(gm, sub)(*feeds)
    s = m.shape[-1]
    if m.dtype == torch.bool:
        allowed = m
    else:
        allowed, blocked = m == 0, m <= torch.finfo(m.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise PlanError(f"{module}'s attention mask adds biases to the scores (not only 0 or -inf): context "
                            "parallelism cannot split it", hint="recompile with --cp 1")
    allowed = allowed.expand(*allowed.shape[:-2], m.shape[-2], s).reshape(-1, m.shape[-2], s)
    tril = torch.ones(m.shape[-2], s, dtype=torch.bool).tril()
    if all(torch.equal(a, tril) for a in allowed):
        return True
    if bool(allowed.all()):
        return False
    raise PlanError(f"{module}'s attention mask is neither causal nor empty (a sliding window, or per-sample?): "
                    "context parallelism splits causal or full attention", hint="recompile with --cp 1")
