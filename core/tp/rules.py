"""Tensor-parallel rules per ATen op: which sharded ``Strategy``s each op offers.

``core/tp/strategies.node_strategies`` looks a node's op up in ``RULES`` (the compute
ops, this module) and ``VIEW_RULES`` (ops that only move dims: core/tp/view_rules.py)
and calls the rule with an ``OpView`` of it; the function lists the op's
non-replicated strategies (the replicated one is added by ``node_strategies``).
Gradient placements are written as if every input carried a gradient;
``node_strategies`` then writes ``"none"`` for inputs that carry none.
Every shard a rule offers divides its dim by t.

The catalog of what each op offers (linear, the matmuls, embedding, attention, conv2d and
pooling, layer_norm, elementwise ops, reductions, softmax, cross-entropy, views) is
docs/architecture.md, "The tensor-parallel rule catalog". batch_norm and the factories
(``REPLICATE_BY_NATURE``) are replicated by nature; every other op without a rule is
replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from partita.core.placement import PARTIAL, REPLICATE, is_shard, shard
from partita.core.tp.vocabulary import Strategy

# Ops replicated by nature rather than for lack of a rule: they make new tensors
# from sizes (no input to follow) or compute whole-tensor statistics.
REPLICATE_BY_NATURE = frozenset({
    "arange", "zeros", "ones", "full", "empty", "new_ones", "new_zeros", "new_full",
    "new_empty", "scalar_tensor", "zeros_like", "ones_like", "full_like", "empty_like",
    "rand", "randn", "randint", "tensor", "batch_norm",
})


@dataclass(frozen=True)
class OpView:
    """What a rule reads of one node (from the DiGraph attributes of core/model/graph.py)."""

    name: str  # ATen packet name: "linear", "add", ...; "getitem" for operator.getitem
    overload: str
    args: list
    kwargs: dict
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    in_floating: list[bool]
    t: int

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if i < len(self.args) else default

    def div(self, size: int) -> bool:
        """Whether a dim of ``size`` can be split in t equal non-empty slices."""
        return size >= self.t and size % self.t == 0

    @property
    def out(self) -> tuple[int, ...]:
        return self.out_shapes[0]


Rule = Callable[[OpView], list[Strategy]]
RULES: dict[str, Rule] = {}  # op name -> rule: the compute ops here, core/tp/view_rules.py's beside them


def registrar(table: dict[str, Rule]) -> Callable[..., Callable[[Rule], Rule]]:
    """A decorator ``@rule("op", ...)`` that files a rule under those op names in ``table``."""
    def rule(*names: str) -> Callable[[Rule], Rule]:
        def register(fn: Rule) -> Rule:
            for n in names:
                table[n] = fn
            return fn
        return register
    return rule


_rule = registrar(RULES)


def rule_strategy(v: OpView, name: str, out: str, ins: list[str], grads: list[str],
              internal: tuple[tuple[str, int], ...] = ()) -> Strategy:
    split = out != REPLICATE or any(p != REPLICATE for p in ins)
    frac = 1 / v.t if split else 1.0
    mem = 1 / v.t if is_shard(out) else 1.0
    return Strategy(name, (out,) * max(1, len(v.out_shapes)) if v.out_shapes else (),
                    tuple(ins), tuple(grads), compute_fraction=frac, memory_fraction=mem,
                    internal=internal)


def _tensor_arg(v: OpView, i: int, name: str) -> int | None:
    """The input index of argument ``i`` / ``name`` when it is a tensor, else None."""
    a = v.arg(i, name)
    return a["input"] if isinstance(a, dict) and "input" in a else None


def _elem(v: OpView) -> int:
    return 4  # bytes per element of internal payloads: fp32 (see layout_decisions)


# -- matrix products -----------------------------------------------------------

@_rule("linear")
def linear(v: OpView) -> list[Strategy]:
    x, w = v.in_shapes[0], v.in_shapes[1]
    has_b = len(v.in_shapes) > 2
    R = len(v.out)
    M, K = w
    out: list[Strategy] = []
    if v.div(M):
        out.append(rule_strategy(v, "col", shard(R - 1), [REPLICATE, shard(0)] + [shard(0)] * has_b,
                             [PARTIAL, shard(0)] + [shard(0)] * has_b))
    if v.div(K):
        out.append(rule_strategy(v, "row", PARTIAL, [shard(len(x) - 1), shard(1)] + [REPLICATE] * has_b,
                             [shard(len(x) - 1), shard(1)] + [PARTIAL] * has_b))
    for d in range(len(x) - 1):
        if v.div(x[d]):
            out.append(rule_strategy(v, shard(d), shard(d), [shard(d)] + [REPLICATE] * (1 + has_b),
                                 [shard(d)] + [PARTIAL] * (1 + has_b)))
    return out


def _bias_along(bias: tuple[int, ...], out_rank: int, out_dim: int, size: int) -> str | None:
    """The bias (right-aligned to the output) dim matching output dim ``out_dim``, when real."""
    d = out_dim - (out_rank - len(bias))
    return shard(d) if d >= 0 and bias[d] == size and size > 1 else None


@_rule("addmm")
def addmm(v: OpView) -> list[Strategy]:
    b, x, w = v.in_shapes  # out = beta * b + alpha * x @ w; x (N, K), w (K, M)
    (N, K), M = x, w[1]
    out: list[Strategy] = []
    if v.div(M):
        bp = _bias_along(b, 2, 1, M)
        out.append(rule_strategy(v, "col", shard(1), [bp or REPLICATE, REPLICATE, shard(1)],
                             [bp or PARTIAL, PARTIAL, shard(1)]))
    if v.div(K):
        out.append(rule_strategy(v, "row", PARTIAL, [REPLICATE, shard(1), shard(0)],
                             [PARTIAL, shard(1), shard(0)]))
    if v.div(N):
        bp = _bias_along(b, 2, 0, N)
        out.append(rule_strategy(v, shard(0), shard(0), [bp or REPLICATE, shard(0), REPLICATE],
                             [bp or PARTIAL, shard(0), PARTIAL]))
    return out


@_rule("mm", "bmm", "matmul")
def matmul(v: OpView) -> list[Strategy]:
    a, b = v.in_shapes[0], v.in_shapes[1]
    if len(a) < 2 or len(b) < 2:
        return []
    R = len(v.out)
    out: list[Strategy] = []
    if v.div(b[-1]):
        out.append(rule_strategy(v, "col", shard(R - 1), [REPLICATE, shard(len(b) - 1)],
                             [PARTIAL, shard(len(b) - 1)]))
    if v.div(a[-1]):
        out.append(rule_strategy(v, "row", PARTIAL, [shard(len(a) - 1), shard(len(b) - 2)],
                             [shard(len(a) - 1), shard(len(b) - 2)]))
    if v.div(a[-2]):
        out.append(rule_strategy(v, shard(R - 2), shard(R - 2), [shard(len(a) - 2), REPLICATE],
                             [shard(len(a) - 2), PARTIAL]))
    for d in range(R - 2):  # batch dims, right-aligned broadcasting
        if v.div(v.out[d]):
            ins, grads = _broadcast_shard([a[:-2], b[:-2]], R - 2, d)
            out.append(rule_strategy(v, shard(d), shard(d), ins, grads))
    return out


# -- embeddings, attention, convolution, normalisation ------------------------

@_rule("embedding")
def embedding(v: OpView) -> list[Strategy]:
    (V, C), idx = v.in_shapes[0], v.in_shapes[1]
    R = len(v.out)
    out: list[Strategy] = []
    if v.div(V):
        out.append(rule_strategy(v, "vocab", PARTIAL, [shard(0), REPLICATE], [shard(0), REPLICATE]))
    if v.div(C):
        out.append(rule_strategy(v, "dim", shard(R - 1), [shard(1), REPLICATE], [shard(1), REPLICATE]))
    for d in range(len(idx)):
        if v.div(idx[d]):
            out.append(rule_strategy(v, shard(d), shard(d), [REPLICATE, shard(d)], [PARTIAL, shard(d)]))
    return out


@_rule("scaled_dot_product_attention")
def sdpa(v: OpView) -> list[Strategy]:
    q, k = v.in_shapes[0], v.in_shapes[1]
    if len(q) != 4:
        return []
    out: list[Strategy] = []
    for name, d in (("heads", 1), (shard(0), 0)):
        if not (v.div(q[d]) and v.div(k[d])):
            continue
        ins, grads = [shard(d)] * 3, [shard(d)] * 3
        for mask in v.in_shapes[3:]:
            md = d - (4 - len(mask))
            real = md >= 0 and mask[md] > 1
            ins.append(shard(md) if real else REPLICATE)
            grads.append(shard(md) if real else PARTIAL)
        out.append(rule_strategy(v, name, shard(d), ins, grads))
    return out


@_rule("conv2d")
def conv2d(v: OpView) -> list[Strategy]:
    if v.arg(6, "groups", 1) != 1 or len(v.in_shapes[0]) != 4:
        return []
    x, w = v.in_shapes[0], v.in_shapes[1]
    has_b = len(v.in_shapes) > 2
    out: list[Strategy] = []
    if v.div(w[0]):
        out.append(rule_strategy(v, "col", shard(1), [REPLICATE, shard(0)] + [shard(0)] * has_b,
                             [PARTIAL, shard(0)] + [shard(0)] * has_b))
    if v.div(x[1]):
        out.append(rule_strategy(v, "row", PARTIAL, [shard(1), shard(1)] + [REPLICATE] * has_b,
                             [shard(1), shard(1)] + [PARTIAL] * has_b))
    if v.div(x[0]):
        out.append(rule_strategy(v, shard(0), shard(0), [shard(0)] + [REPLICATE] * (1 + has_b),
                             [shard(0)] + [PARTIAL] * (1 + has_b)))
    return out


@_rule("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d")
def pool(v: OpView) -> list[Strategy]:
    x = v.in_shapes[0]
    return [rule_strategy(v, shard(d), shard(d), [shard(d)], [shard(d)])
            for d in range(len(x) - 2) if v.div(x[d])]


@_rule("layer_norm")
def layer_norm(v: OpView) -> list[Strategy]:
    x = v.in_shapes[0]
    kept = len(x) - len(v.arg(1, "normalized_shape"))
    extra = len(v.in_shapes) - 1
    return [rule_strategy(v, shard(d), shard(d), [shard(d)] + [REPLICATE] * extra, [shard(d)] + [PARTIAL] * extra)
            for d in range(kept) if v.div(x[d])]


# -- elementwise ----------------------------------------------------------------

_ADDITIVE = frozenset({"add", "sub"})
_MULTIPLICATIVE = frozenset({"mul", "div"})
_LINEAR_UNARY = frozenset({"neg"})
_ELEMENTWISE = _ADDITIVE | _MULTIPLICATIVE | _LINEAR_UNARY | frozenset({
    "gelu", "silu", "relu", "tanh", "sigmoid", "pow", "rsqrt", "sqrt", "exp", "log", "abs",
    "sin", "cos", "erf", "reciprocal", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
    "where", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__",
    "logical_and", "logical_or", "logical_not", "bitwise_not", "sign", "square", "softplus",
    "leaky_relu", "hardtanh", "elu", "mish", "hardswish", "hardsigmoid", "log1p", "expm1",
})


def _broadcast_shard(shapes: list[tuple[int, ...]], R: int, d: int) -> tuple[list[str], list[str]]:
    """Placements for inputs broadcast (right-aligned) to rank R when the output is shard(d)."""
    ins, grads = [], []
    for s in shapes:
        di = d - (R - len(s))
        if di >= 0 and s[di] > 1:
            ins.append(shard(di))
            grads.append(shard(di))
        else:
            ins.append(REPLICATE)
            grads.append(PARTIAL)
    return ins, grads


@_rule(*_ELEMENTWISE)
def elementwise(v: OpView) -> list[Strategy]:
    R = len(v.out)
    out: list[Strategy] = []
    for d in range(R):
        if v.div(v.out[d]):
            ins, grads = _broadcast_shard(v.in_shapes, R, d)
            out.append(rule_strategy(v, shard(d), shard(d), ins, grads))
    n = len(v.in_shapes)
    if v.name in _ADDITIVE and n >= 2 and len(v.args) >= 2 and isinstance(v.args[1], dict):
        out.append(rule_strategy(v, PARTIAL, PARTIAL, [PARTIAL] * n, [REPLICATE] * n))
    if v.name in _LINEAR_UNARY:
        out.append(rule_strategy(v, PARTIAL, PARTIAL, [PARTIAL], [REPLICATE]))
    if v.name in _MULTIPLICATIVE:
        for j in range(1 if v.name == "div" else n):
            ins = [PARTIAL if i == j else REPLICATE for i in range(n)]
            grads = [REPLICATE if i == j else PARTIAL for i in range(n)]
            out.append(rule_strategy(v, PARTIAL if j == 0 else f"{PARTIAL}({j})", PARTIAL, ins, grads))
    return out


# -- reductions and softmax --------------------------------------------------------

@_rule("sum", "mean", "amax", "amin")
def reduction(v: OpView) -> list[Strategy]:
    x = v.in_shapes[0]
    whole = v.name in ("sum", "mean") and v.overload == "default"
    dims = None if whole else v.arg(1, "dim")
    reduced = {d % len(x) for d in dims} if dims else set(range(len(x)))
    keep = not whole and bool(v.arg(2, "keepdim", False))
    linear = v.name in ("sum", "mean")
    out: list[Strategy] = []
    for d in range(len(x)):
        if not v.div(x[d]):
            continue
        if d in reduced:
            if linear:
                out.append(rule_strategy(v, shard(d), PARTIAL, [shard(d)], [shard(d)]))
        else:
            od = d if keep else d - sum(1 for r in reduced if r < d)
            out.append(rule_strategy(v, shard(d), shard(od), [shard(d)], [shard(d)]))
    if linear:
        out.append(rule_strategy(v, PARTIAL, PARTIAL, [PARTIAL], [REPLICATE]))
    return out


@_rule("softmax", "_softmax", "log_softmax", "_log_softmax")
def softmax(v: OpView) -> list[Strategy]:
    x = v.in_shapes[0]
    k = v.arg(1, "dim") % len(x)
    out: list[Strategy] = []
    for d in range(len(x)):
        if not v.div(x[d]):
            continue
        if d != k:
            out.append(rule_strategy(v, shard(d), shard(d), [shard(d)], [shard(d)]))
        else:
            outer = 1
            for i, s in enumerate(x):
                outer *= s if i != k else 1
            internal = (("all_reduce", outer * _elem(v)),) * 3
            out.append(rule_strategy(v, "vocab", shard(d), [shard(d)], [shard(d)], internal))
    return out


@_rule("cross_entropy_loss")
def cross_entropy(v: OpView) -> list[Strategy]:
    logits = v.in_shapes[0]
    if (len(logits) != 2 or _tensor_arg(v, 2, "weight") is not None
            or v.arg(3, "reduction", 1) != 1 or v.arg(5, "label_smoothing", 0.0) != 0.0):
        return []
    N, C = logits
    out: list[Strategy] = []
    if v.div(C):
        # the loss is whole on every rank, but what it saves (the softmax) and allocates are its class shard
        out.append(replace(rule_strategy(v, "vocab", REPLICATE, [shard(1), REPLICATE], [shard(1), REPLICATE],
                                         (("all_reduce", N * _elem(v)),) * 3), memory_fraction=1 / v.t))
    if v.div(N):
        out.append(rule_strategy(v, shard(0), PARTIAL, [shard(0), shard(0)], [shard(0), shard(0)],
                             (("all_reduce", 8),)))
    return out
