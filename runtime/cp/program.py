"""What context parallelism changes in a rank's program (runtime/tp/program.py builds it).

The rank's training graph is captured at its own sequence slice (``mesh.cp`` x fewer tokens than
the plan's inputs, runtime/tp/module.py), so every op but attention already runs on its tokens.
``ContextParallel`` finds, on that graph, the two kinds of node that must see the whole sequence:

- each ``torch.arange`` over the slice's length (the sequence's positions: a learned position
  table's index, a rotary embedding's, a mask's) gives this rank's true positions
  (core/mesh.py ``sequence_positions``) in its place;
- each ``scaled_dot_product_attention`` runs over the cp group (runtime/cp/attention.py), causal
  or not as its mask says: ``is_causal``, or a mask computed from positions alone that is the
  causal one (or none) on a whole sequence;
- each attention written out (Q K^T, scale, mask, softmax, P V; found as core/recompute.py finds
  a core) runs the same way from its closing matmul, what it computes found by running the span
  once on random values: causal or full attention at its scale.

A mask it cannot split (one read from a model input, a padding or sliding-window mask, a bias),
and attention dropout are refused before the first step, naming the module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.fx

from partita.core.errors import PlanError
from partita.core.model.ops import ATTENTION
from partita.runtime.cp.attention import ContextGroup, attention

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ARANGE = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


class Core(NamedTuple):
    """One attention call over the cp group: whether causal, its scale, and the model input that
    marks padded keys (None: no padding mask)."""

    g: ContextGroup
    strategy: str
    causal: bool
    scale: float
    pad: torch.fx.Node | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return attention(q, k, v, self.g, self.strategy, self.causal, self.scale, pad)


class ContextParallel:
    """The nodes of a rank's graph that context parallelism replaces, and what replaces each."""

    def __init__(self, g: ContextGroup, strategy: str, graph_module: torch.fx.GraphModule, *,
                 user_inputs: set[str], buffers: dict[str, torch.Tensor], module_of: dict[str, str],
                 micro_batch: int) -> None:
        self.g, self.strategy = g, strategy
        local = g.seq_len // g.size
        graph = graph_module.graph
        self.positions: dict[str, torch.dtype] = {}  # arange node -> its dtype
        self.cores: dict[str, Core] = {}
        attention_nodes = [n for n in graph.nodes if n.op == "call_function"
                           and getattr(n.target, "__name__", "").split(".")[0] in ATTENTION]
        for n in attention_nodes:
            self.cores[n.name] = self._core(n, graph_module, user_inputs, buffers, module_of.get(n.name, "") or n.name)
        # attention written out (Q K^T, its scale and mask, softmax, P V): the span runs as one core,
        # the closing P V computing it and the nodes before it in the span none
        self.skipped: set[str] = set()
        self.spans: dict[str, tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]] = {}  # closing -> q, k^T, v
        written = []
        for opening, closing, span in _written_cores(graph, user_inputs):
            module = module_of.get(closing.name, "") or closing.name
            self.cores[closing.name] = self._probe(opening, closing, span, graph_module, user_inputs, buffers, module)
            self.spans[closing.name] = (opening.args[0], opening.args[1], closing.args[1])
            self.skipped |= {n.name for n in span if n is not closing}
            written.append(closing)
        masks = _ancestors([_mask_of(n) for n in attention_nodes if isinstance(_mask_of(n), torch.fx.Node)]
                           + [m for c in written for m in _outside(graph, self.skipped, self.spans[c.name])])
        for n in graph.nodes:
            # an arange over the slice is its positions where they reach more than a mask (which the
            # attention over "cp" replaces): a position table's index, a rotary angle; a mask's own
            # index over the slice stays as it was captured
            if n.op == "call_function" and n.target in _ARANGE and _spans(n) == local \
                    and _reaches_beyond(n, masks, set(attention_nodes) | set(written)):
                if micro_batch == local:
                    raise PlanError(f"the micro-batch of {micro_batch} samples equals the {local} tokens each cp rank "
                                    "holds: partita cannot tell the sequence's positions (torch.arange) from the "
                                    "batch's", hint="compile with another --micro-batch-size or --cp")
                self.positions[n.name] = n.kwargs.get("dtype") or torch.int64
        if not self.cores:
            raise PlanError("context parallelism splits the sequence around attention, and this model has none "
                            "(scaled_dot_product_attention, or Q K^T, softmax and P V written out)",
                            hint="recompile with --cp 1")

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
        pad = None
        if isinstance(mask, torch.fx.Node):
            causal, pad = _mask_is_causal(mask, gm, user_inputs, buffers, module)
        q = n.args[0].meta["val"]
        scale = n.kwargs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
        heads = q.shape[1]
        if self.strategy == "all-to-all" and heads % self.g.size:
            raise PlanError(f"{module}: {heads} heads on this rank do not divide over cp={self.g.size} for "
                            "all-to-all attention", hint="recompile with --cp-attention ring")
        return Core(self.g, self.strategy, causal, float(scale), pad)

    def replaces(self, name: str) -> bool:
        return name in self.positions or name in self.cores or name in self.skipped

    def emit(self, builder: Any, n: torch.fx.Node, args: list, kwargs: dict) -> torch.fx.Node | None:
        """The node that stands for ``n`` in the rank's program (``builder``: runtime/tp/program.py's;
        None for a node of a written-out core that its closing matmul computes)."""
        if n.name in self.positions:
            return builder.attr("positions", self.g.positions().to(self.positions[n.name]))
        if n.name in self.skipped:
            return None
        from partita.runtime.tp.program import call

        core = builder.attr("cp_attention", self.cores[n.name])
        if n.name in self.spans:  # written out: q and k^T as the opening matmul read them, v the closing's
            q, kt, v = (builder.env[x] for x in self.spans[n.name])
            k = builder.graph.call_function(torch.transpose, (kt, -2, -1))
            return builder.graph.call_function(call, (core, q, k, v))
        pad = self.cores[n.name].pad
        if pad is not None and pad not in builder.env:
            raise PlanError(f"node {n.name}: its attention's padding mask ({pad.name}) is read on another pipeline "
                            "stage", hint="recompile with --pp 1, or without the attention mask")
        return builder.graph.call_function(call, (core, *args[:3], *([builder.env[pad]] if pad is not None else [])))

    def _probe(self, opening: torch.fx.Node, closing: torch.fx.Node, span: list[torch.fx.Node],
               gm: torch.fx.GraphModule, user_inputs: set[str], buffers: dict[str, torch.Tensor],
               module: str) -> Core:
        """What a written-out core computes, found by running it once on random q, k and v over a
        whole sequence of the slice's length: causal or full scaled dot-product attention at the
        scale its constants give (or 1/sqrt(head dim)); anything else is refused naming ``module``."""
        q_node, kt_node, v_node = opening.args[0], opening.args[1], closing.args[1]
        for x in span:
            if getattr(x.target, "__name__", "").split(".")[0] in ("dropout", "native_dropout") and x.args[1]:
                raise PlanError(f"{module}'s attention drops probabilities (p={x.args[1]}): context parallelism "
                                "does not split attention dropout", hint="set the attention dropout to 0, or --cp 1")
        inside = set(span)
        outside = _ancestors([a for x in span for a in x.all_input_nodes if a not in inside
                              and a not in (q_node, kt_node, v_node)])
        for x in outside:
            if x.op == "placeholder" and x.name not in buffers:
                what = "a model input" if x.name in user_inputs else "a parameter"
                raise PlanError(f"{module}'s attention reads {what} ({x.name}, a padding mask?) between Q K^T and "
                                "P V: context parallelism splits a mask computed from positions only",
                                hint="train on unpadded (packed) sequences without an attention mask, or --cp 1")
        run, feeds = _alone(gm, outside | inside, closing, (q_node, kt_node, v_node), buffers)
        shapes = [tuple(x.meta["val"].shape) for x in (q_node, kt_node, v_node)]
        g = torch.Generator().manual_seed(0)
        q, kt, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
        with torch.no_grad():
            got = run(q, kt, v, *feeds).double()
        k = kt.transpose(-2, -1)
        scales = {1.0 / math.sqrt(q.shape[-1]), _constant_scale(span)}
        for scale in sorted(scales):
            for causal in (True, False):
                want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
                if torch.allclose(got, want, rtol=1e-6, atol=1e-8):
                    return Core(self.g, self.strategy, causal, float(scale))
        raise PlanError(f"{module} computes attention with more than a scale and a causal mask between Q K^T "
                        "and P V (a bias, a sliding window?): context parallelism cannot split it",
                        hint="write it with F.scaled_dot_product_attention, or recompile with --cp 1")


def _alone(gm: torch.fx.GraphModule, keep: set[torch.fx.Node], output: torch.fx.Node,
           given: Sequence[torch.fx.Node], buffers: dict[str, torch.Tensor]) -> tuple[torch.fx.GraphModule, list]:
    """The nodes ``keep`` of ``gm`` (in its order) as a program of their own returning ``output``: its
    arguments the values of the ``given`` nodes, then of the buffers it reads, whose values (on the
    CPU) come back beside it to pass after them."""
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {x: sub.placeholder(x.name) for x in given}
    feeds = []
    for x in gm.graph.nodes:
        if x in keep and x not in env:
            if x.op == "placeholder":
                env[x] = sub.placeholder(x.name)
                feeds.append(buffers[x.name].detach().cpu())
            else:
                env[x] = sub.node_copy(x, lambda a: env[a])
    sub.output(env[output])
    return torch.fx.GraphModule(gm, sub), feeds


def _written_cores(graph: torch.fx.Graph, user_inputs: set[str]
                   ) -> list[tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """Attention written out, as core/recompute.py finds its core: a matmul of two values computed
    from the model's inputs (Q K^T: no parameter, no projection) opens it, and the first matmul
    it reaches whose other operand is such a value (P V) closes it. Each (opening, closing, the
    span: the nodes the opening reaches that the closing is computed from, both included)."""
    from_input: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name in user_inputs) or any(a in from_input for a in n.all_input_nodes):
            from_input.add(n)
    found = []
    taken: set[torch.fx.Node] = set()
    for a in graph.nodes:
        if a in taken or not _is_matmul(a) or len(a.args) < 2 or not all(
                isinstance(x, torch.fx.Node) and x in from_input for x in a.args[:2]):
            continue
        reach, order = {a}, [a]
        closing = None
        for n in graph.nodes:  # program order: the nodes after ``a`` it reaches
            if n is a or n in reach or not any(x in reach for x in n.all_input_nodes):
                continue
            reach.add(n)
            order.append(n)
            if _is_matmul(n) and len(n.args) >= 2 and n.args[0] in reach and isinstance(n.args[1], torch.fx.Node) \
                    and n.args[1] not in reach and n.args[1] in from_input:
                closing = n
                break
        if closing is None:
            continue
        span = [n for n in order if n in _ancestors([closing])]
        found.append((a, closing, span))
        taken |= set(span)
    return found


def _is_matmul(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in ("matmul", "bmm")


def _outside(graph: torch.fx.Graph, skipped: set[str], qkv: tuple[torch.fx.Node, ...]) -> list[torch.fx.Node]:
    """The nodes written-out cores read from outside them other than their q, k^T and v: their masks'."""
    span = {n for n in graph.nodes if n.name in skipped}
    return [a for x in span for a in x.all_input_nodes if a not in span and a not in qkv]


def _constant_scale(span: list[torch.fx.Node]) -> float:
    """The product of the scalar constants a core's scores are multiplied (or divided) by."""
    scale = 1.0
    for x in span:
        name = getattr(x.target, "__name__", "").split(".")[0]
        if name in ("mul", "div") and len(x.args) > 1 and isinstance(x.args[1], (int, float)):
            scale = scale * x.args[1] if name == "mul" else scale / x.args[1]
    return scale


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
                    buffers: dict[str, torch.Tensor], module: str) -> tuple[bool, torch.fx.Node | None]:
    """What the attention mask ``mask`` is, evaluated on the captured slice as a whole sequence:
    (True, None) the causal one, (False, None) none at all; (causal, pad) either of them with the
    keys a model input ``pad`` marks as padding (0) masked out, the mask a padded batch gives
    (tried on right-padded and on random rows). Refused when it reads a parameter or two inputs,
    or is another mask (a sliding window, a bias)."""
    seen = _ancestors([mask])
    pads = sorted((x for x in seen if x.op == "placeholder" and x.name not in buffers), key=lambda x: x.name)
    for x in pads:
        if x.name not in user_inputs:
            raise PlanError(f"{module}'s attention mask reads a parameter ({x.name}): context parallelism "
                            "splits a mask of positions and padding only", hint="recompile with --cp 1")
    if len(pads) > 1:
        raise PlanError(f"{module}'s attention mask reads {len(pads)} model inputs "
                        f"({', '.join(p.name for p in pads)}): context parallelism splits a mask of positions and "
                        "one padding mask", hint="pass one attention_mask, or --cp 1")
    pad = pads[0] if pads else None
    run, feeds = _alone(gm, seen, mask, [pad] if pad is not None else [], buffers)
    trials = [None]
    if pad is not None:
        val = pad.meta["val"]
        b, s = val.shape[0], val.shape[1]
        g = torch.Generator().manual_seed(0)
        right = (torch.arange(s)[None, :] < torch.randint(1, s + 1, (b, 1), generator=g)).to(val.dtype)
        trials = [right, torch.randint(0, 2, (b, s), generator=g).to(val.dtype)]
    found = set()
    for values in trials:
        with torch.no_grad():
            m = run(*([values] if pad is not None else []), *feeds)
        found.add(_kind_of(m, values, module))
    if len(found) == 1 and None not in found:
        return found.pop(), pad
    raise PlanError(f"{module}'s attention mask is neither causal nor full attention"
                    + (" with padded keys" if pad is not None else "") + " (a sliding window, per-sample "
                    "positions?): context parallelism cannot split it", hint="recompile with --cp 1")


def _kind_of(m: torch.Tensor, pad: torch.Tensor | None, module: str) -> bool | None:
    """True when the evaluated mask ``m`` is the causal one, False when it allows every key (each less
    the keys ``pad`` marks as padding), None when it is neither."""
    if m.dtype == torch.bool:
        allowed = m
    else:
        allowed, blocked = m == 0, m <= torch.finfo(m.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise PlanError(f"{module}'s attention mask adds biases to the scores (not only 0 or -inf): context "
                            "parallelism cannot split it", hint="recompile with --cp 1")
    q, s = allowed.shape[-2], allowed.shape[-1]
    keys = torch.ones(1, s, dtype=torch.bool) if pad is None else pad != 0  # [b or 1, s]
    for causal in (True, False):
        want = keys[:, None, None, :]
        if causal:
            want = want & torch.ones(q, s, dtype=torch.bool).tril()
        try:
            shape = torch.broadcast_shapes(allowed.shape, want.shape)
        except RuntimeError:
            return None
        if torch.equal(allowed.broadcast_to(shape), want.broadcast_to(shape)):
            return causal
    return None
