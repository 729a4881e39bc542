"""Tensor-parallel rules of the ops that only move dims: views, transposes, splits, concatenation,
getitem and the identity-like ops. Their catalog is docs/architecture.md, "The tensor-parallel
rule catalog" ("Views"); each rule maps an input's shard(d) to the output dim d lands on.
"""

from __future__ import annotations

from collections.abc import Callable

from partita.core.placement import PARTIAL, REPLICATE, shard
from partita.core.tp.rules import OpView, Rule, registrar, rule_strategy
from partita.core.tp.vocabulary import Strategy

VIEW_RULES: dict[str, Rule] = {}
_rule = registrar(VIEW_RULES)


def _passthrough(v: OpView, remap: Callable[[int], int | None], *, linear: bool = True) -> list[Strategy]:
    """Strategies of an op whose first input's shard(d) becomes shard(remap(d)) on every output."""
    x = v.in_shapes[0]
    rest = len(v.in_shapes) - 1
    out: list[Strategy] = []
    for d in range(len(x)):
        o = remap(d)
        if not v.div(x[d]) or o is None or not all(v.div(s[o]) for s in v.out_shapes):
            continue
        out.append(rule_strategy(v, shard(d), shard(o), [shard(d)] + [REPLICATE] * rest,
                             [shard(d)] + [PARTIAL] * rest))
    if linear:
        out.append(rule_strategy(v, PARTIAL, PARTIAL, [PARTIAL] * (1 + rest), [REPLICATE] * (1 + rest)))
    return out


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Dims of ``src`` and ``dst`` paired into groups of equal element count (how a view
    regroups dims); unit dims left at the end join the last group. None if no pairing
    exists (zero-size dims)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, pi, pj = [i], [j], src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif pj < pi and j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return None
        groups.append((gi, gj))
    if not groups:
        return None
    groups[-1][0].extend(range(i, len(src)))
    groups[-1][1].extend(range(j, len(dst)))
    return groups


def view_dim(src: tuple[int, ...], dst: tuple[int, ...], d: int) -> int | None:
    """The ``dst`` dim that ``shard(d)`` of ``src`` becomes through a view, or None."""
    for gi, gj in view_groups(src, dst) or ():
        if d in gi:
            if any(src[i] > 1 for i in gi if i < d):
                return None  # not the leading factor of its group
            lead = [j for j in gj if dst[j] > 1]
            return lead[0] if lead else None
    return None


@_rule("view", "reshape", "_unsafe_view", "flatten", "unflatten")
def view(v: OpView) -> list[Strategy]:
    return _passthrough(v, lambda d: view_dim(v.in_shapes[0], v.out, d))


@_rule("transpose", "t", "permute", "unsqueeze", "squeeze", "select", "slice", "expand")
def remap_dims(v: OpView) -> list[Strategy]:
    x, R = v.in_shapes[0], len(v.out)
    n = len(x)
    if v.name in ("transpose", "t"):
        a, b = (v.arg(1, "dim0") % n, v.arg(2, "dim1") % n) if v.name == "transpose" else (0, 1 % max(n, 1))
        return _passthrough(v, lambda d: b if d == a else a if d == b else d)
    if v.name == "permute":
        perm = [p % n for p in v.arg(1, "dims")]
        return _passthrough(v, lambda d: perm.index(d))
    if v.name == "unsqueeze":
        k = v.arg(1, "dim") % R
        return _passthrough(v, lambda d: d if d < k else d + 1)
    if v.name == "squeeze":
        dims = v.arg(1, "dim")
        dims = [dims] if isinstance(dims, int) else dims
        gone = {d % n for d in dims} if dims is not None else set(range(n))
        gone = {d for d in gone if x[d] == 1}
        return _passthrough(v, lambda d: d - sum(1 for g in gone if g < d))
    if v.name in ("select", "slice"):
        k = v.arg(1, "dim", 0) % n
        if v.name == "select":
            return _passthrough(v, lambda d: None if d == k else d if d < k else d - 1)
        return _passthrough(v, lambda d: None if d == k else d)
    # expand: right-aligned; a real (size > 1) input dim is never expanded
    return _passthrough(v, lambda d: d + (R - n) if x[d] > 1 else None)


@_rule("split", "split_with_sizes", "chunk")
def split(v: OpView) -> list[Strategy]:
    x = v.in_shapes[0]
    k = v.arg(2, "dim", 0) % len(x)
    return _passthrough(v, lambda d: None if d == k else d)


@_rule("cat")
def cat(v: OpView) -> list[Strategy]:
    R, n = len(v.out), len(v.in_shapes)
    k = v.arg(1, "dim", 0) % R
    if any(len(s) != R for s in v.in_shapes):
        return []  # legacy empty-tensor concatenation
    out = [rule_strategy(v, shard(d), shard(d), [shard(d)] * n, [shard(d)] * n)
           for d in range(R) if d != k and v.div(v.out[d])]
    out.append(rule_strategy(v, PARTIAL, PARTIAL, [PARTIAL] * n, [REPLICATE] * n))
    return out


@_rule("contiguous", "clone", "alias", "to", "_to_copy", "type_as", "dropout",
       "_assert_tensor_metadata", "detach", "lift_fresh_copy")
def identity(v: OpView) -> list[Strategy]:
    linear = not (v.name == "dropout" and v.arg(1, "p", 0.0) > 0 and v.arg(2, "train", True))
    return _passthrough(v, lambda d: d, linear=linear)


@_rule("getitem")
def getitem(v: OpView) -> list[Strategy]:
    return _passthrough(v, lambda d: d)
