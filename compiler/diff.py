"""What changed between two plans: `partita diff A.json B.json` and the view's `--against`.

``diff_plans(a, b)`` reads two plans and nothing else. Changes are stated
from ``a`` (the baseline) to ``b``: a layout that was ``shard(0)`` in ``a``
and is ``replicate`` in ``b``, a step time that is ``b / a`` times ``a``'s.
Parameters and nodes are matched by name, stages by index, collectives as
multisets (a collective whose size or count changed is one removed and one
added).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import click
from rich.console import Group, RenderableType
from rich.table import Table

from partita.compiler.report import fmt_bytes, fmt_time, plain
from partita.core.plans.plan import NodeDecision, Plan
from partita.core.plans.verify import load_plan

# Inserted collectives on an edge are every reshard but these two (no traffic).
FREE_RESHARDS = ("none", "slice")


@dataclass(frozen=True)
class Change:
    """One field that differs: its value in ``a`` and in ``b``."""

    field: str
    a: Any
    b: Any


@dataclass(frozen=True)
class LayoutChange:
    """The parameters of one module whose split changed, and its nodes whose strategy changed."""

    module: str
    params: tuple[Change, ...] = ()  # field = parameter name; a/b = "tp=shard(0), dp=replicate" (None: absent)
    nodes: tuple[Change, ...] = ()  # field = node name; a/b = strategy (None: absent)


@dataclass(frozen=True)
class StageChange:
    """A pipeline stage whose boundaries or contents moved (None: the stage does not exist there)."""

    index: int
    a: str | None
    b: str | None


@dataclass(frozen=True)
class MetricDelta:
    """A predicted number in both plans; ``ratio`` is b / a."""

    name: str
    unit: str  # "s" | "bytes" | "1/s" | "fraction"
    a: float | None
    b: float | None
    lower_is_better: bool

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a

    @property
    def changed(self) -> bool:
        return self.a != self.b

    @property
    def better(self) -> bool | None:
        """Whether ``b`` improves on ``a`` (None when unchanged or not comparable)."""
        if self.a is None or self.b is None or self.a == self.b:
            return None
        return (self.b < self.a) == self.lower_is_better


@dataclass(frozen=True)
class PlanDiff:
    a_name: str
    b_name: str
    model: tuple[Change, ...]  # name, fingerprint, params
    cluster: tuple[Change, ...]
    mesh: Change | None  # "dp=8 x tp=1 x pp=1" in each
    training: tuple[Change, ...]
    layouts: tuple[LayoutChange, ...]
    stages: tuple[StageChange, ...]
    collectives_added: tuple[str, ...]
    collectives_removed: tuple[str, ...]
    metrics: tuple[MetricDelta, ...]  # every metric, changed or not

    @property
    def same_model(self) -> bool:
        return not any(c.field == "fingerprint" for c in self.model)

    @property
    def identical(self) -> bool:
        """No decision and no prediction differs."""
        return not (self.model or self.cluster or self.mesh or self.training or self.layouts or self.stages
                    or self.collectives_added or self.collectives_removed
                    or any(m.changed for m in self.metrics))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for m, d in zip(self.metrics, out["metrics"]):
            d.update(ratio=m.ratio, changed=m.changed, better=m.better)
        out["identical"] = self.identical
        return out


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """The changes from plan ``a`` to plan ``b``."""
    return PlanDiff(
        a_name=a.model.name,
        b_name=b.model.name,
        model=_changes([("name", a.model.name, b.model.name),
                        ("fingerprint", a.model.fingerprint, b.model.fingerprint),
                        ("num_params", a.model.num_params, b.model.num_params)]),
        cluster=_changes((k, a.cluster.get(k), b.cluster.get(k))
                         for k in ("name", "nodes", "gpus_per_node", "device_name")),
        mesh=None if a.mesh == b.mesh else Change("mesh", str(a.mesh), str(b.mesh)),
        training=_changes((f.name, getattr(a.training, f.name), getattr(b.training, f.name))
                          for f in dataclasses.fields(a.training)),
        layouts=_layout_changes(a, b),
        stages=_stage_changes(a, b),
        collectives_added=_multiset_minus(_collectives(b), _collectives(a)),
        collectives_removed=_multiset_minus(_collectives(a), _collectives(b)),
        metrics=_metrics(a, b),
    )


def _changes(rows: Iterable[tuple[str, Any, Any]]) -> tuple[Change, ...]:
    return tuple(Change(k, x, y) for k, x, y in rows if x != y)


def layout_text(layout: dict[str, str] | Any) -> str:
    """A parameter's layout over the mesh axes as one string, tp first: "tp=shard(0), dp=replicate"."""
    order = {"tp": 0, "pp": 1, "dp": 2}
    return ", ".join(f"{k}={layout[k]}" for k in sorted(layout, key=lambda k: (order.get(k, 9), k)))


def module_of(param_name: str) -> str:
    return param_name.rpartition(".")[0] or "(root)"


def _layout_changes(a: Plan, b: Plan) -> tuple[LayoutChange, ...]:
    params: dict[str, list[Change]] = {}
    pa = {p.name: layout_text(p.layout) for p in a.params}
    pb = {p.name: layout_text(p.layout) for p in b.params}
    for name in _ordered_union(pa, pb):
        if pa.get(name) != pb.get(name):
            params.setdefault(module_of(name), []).append(Change(name, pa.get(name), pb.get(name)))
    nodes: dict[str, list[Change]] = {}
    na: dict[str, NodeDecision] = {n.name: n for n in a.nodes}
    nb: dict[str, NodeDecision] = {n.name: n for n in b.nodes}
    for name in _ordered_union(na, nb):
        sa = na[name].strategy if name in na else None
        sb = nb[name].strategy if name in nb else None
        if sa != sb:
            module = (nb.get(name) or na[name]).module or "(root)"
            nodes.setdefault(module, []).append(Change(name, sa, sb))
    return tuple(LayoutChange(m, tuple(params.get(m, ())), tuple(nodes.get(m, ())))
                 for m in _ordered_union(params, nodes))


def _ordered_union(*keyed: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(k for d in keyed for k in d))


def stage_text(plan: Plan, i: int) -> str | None:
    if i >= len(plan.stages):
        return None
    s = plan.stages[i]
    mods = f" [{', '.join(s.modules)}]" if s.modules else ""
    return f"{s.first_node} .. {s.last_node} ({s.nodes} nodes, {s.params:,} params){mods}"


def _stage_changes(a: Plan, b: Plan) -> tuple[StageChange, ...]:
    out = []
    for i in range(max(len(a.stages), len(b.stages))):
        ta, tb = stage_text(a, i), stage_text(b, i)
        if ta != tb:
            out.append(StageChange(i, ta, tb))
    return tuple(out)


def _collectives(plan: Plan) -> Counter[str]:
    """Every collective of a plan, as readable strings: the per-step ones and those inserted on edges."""
    out: Counter[str] = Counter()
    for c in plan.collectives:
        out[f"{c.kind} over {c.axis} (group {c.group_size}): {c.count} x {fmt_bytes(c.bytes)}, {c.purpose}"] += 1
    for n in plan.nodes:
        for e in n.ins:
            for direction, kind in (("forward", e.fwd), ("backward", e.bwd)):
                if kind not in FREE_RESHARDS:
                    out[f"{direction} {kind} on {e.src} -> {n.name} ({n.module or '(root)'}): "
                        f"{fmt_bytes(e.bytes)}"] += 1
        for item in n.internal:
            kind, _, nbytes = item.partition(":")
            out[f"{kind} inside {n.name} ({n.module or '(root)'}): {fmt_bytes(int(nbytes))}"] += 1
    return out


def _multiset_minus(x: Counter[str], y: Counter[str]) -> tuple[str, ...]:
    rest = x - y
    return tuple(k if rest[k] == 1 else f"{k} (x{rest[k]})" for k in sorted(rest))


def _metrics(a: Plan, b: Plan) -> tuple[MetricDelta, ...]:
    pa, pb = a.predicted, b.predicted
    rows = [
        ("step time", "s", pa.step_time_s, pb.step_time_s, True),
        ("compute", "s", pa.compute_s, pb.compute_s, True),
        *((f"comm {k}", "s", pa.comm_s.get(k), pb.comm_s.get(k), True) for k in _ordered_union(pa.comm_s, pb.comm_s)),
        ("optimizer", "s", pa.optimizer_s, pb.optimizer_s, True),
        ("memory/device", "bytes", pa.memory.total, pb.memory.total, True),
        ("params/device", "bytes", pa.memory.params, pb.memory.params, True),
        ("grads/device", "bytes", pa.memory.grads, pb.memory.grads, True),
        ("optimizer state/device", "bytes", pa.memory.optimizer, pb.memory.optimizer, True),
        ("activations/device", "bytes", pa.memory.activations, pb.memory.activations, True),
        ("samples/s", "1/s", pa.samples_per_s, pb.samples_per_s, False),
        ("tokens/s", "1/s", pa.tokens_per_s, pb.tokens_per_s, False),
        ("MFU", "fraction", pa.mfu, pb.mfu, False),
    ]
    return tuple(MetricDelta(*r) for r in rows)


def fmt_metric(unit: str, v: float | None) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return fmt_time(v)
    if unit == "bytes":
        return fmt_bytes(v)
    if unit == "fraction":
        return f"{v:.1%}"
    return f"{v:,.1f}"


# -- terminal -----------------------------------------------------------------

_LIST_LIMIT = 20


def diff_table(d: PlanDiff) -> RenderableType:
    """The diff as rich tables for the terminal."""
    parts: list[RenderableType] = []
    title = plain(f"plan diff: {d.a_name} (a) -> {d.b_name} (b)")
    if d.identical:
        return Group(f"[bold]{title}[/]: the plans make the same decisions and predictions")
    parts.append(f"[bold]{title}[/]")
    fields = Table(title="decisions", title_justify="left", title_style="bold")
    for col in ("what", "a", "b"):
        fields.add_column(col)
    for group, changes in (("model", d.model), ("cluster", d.cluster), ("", (d.mesh,) if d.mesh else ()),
                           ("training", d.training)):
        for c in changes:
            fields.add_row(plain(f"{group} {c.field}".strip()), plain(c.a), plain(c.b), style="yellow")
    if fields.row_count:
        parts.append(fields)
    if not d.same_model:
        parts.append("[yellow]the plans were made for different graphs (fingerprints differ): "
                     "layouts and collectives are matched by name and may not correspond[/]")

    metrics = Table(title="predicted", title_justify="left", title_style="bold")
    for col in ("metric", "a", "b", "b / a"):
        metrics.add_column(col)
    for m in d.metrics:
        ratio = "-" if m.ratio is None else f"{m.ratio:.3g}x"
        style = "" if m.better is None else ("green" if m.better else "red")
        metrics.add_row(m.name, fmt_metric(m.unit, m.a), fmt_metric(m.unit, m.b), ratio, style=style)
    parts.append(metrics)

    if d.layouts:
        t = Table(title="layout changes by module", title_justify="left", title_style="bold")
        for col in ("module", "what", "a", "b"):
            t.add_column(col)
        rows = [(lc.module, c.field, c.a, c.b) for lc in d.layouts for c in (*lc.params, *lc.nodes)]
        for module, what, x, y in rows[:_LIST_LIMIT]:
            t.add_row(plain(module), plain(what.removeprefix(module + ".")), plain(x or "-"), plain(y or "-"))
        if len(rows) > _LIST_LIMIT:
            t.add_row(f"... {len(rows) - _LIST_LIMIT} more", "", "", "")
        parts.append(t)
    if d.stages:
        t = Table(title="stage boundaries", title_justify="left", title_style="bold")
        for col in ("stage", "a", "b"):
            t.add_column(col)
        for s in d.stages:
            t.add_row(str(s.index), plain(s.a or "-"), plain(s.b or "-"))
        parts.append(t)
    for title, items, colour in (("collectives added", d.collectives_added, "green"),
                                 ("collectives removed", d.collectives_removed, "red")):
        if items:
            t = Table(title=f"{title} ({len(items)})", title_justify="left", title_style="bold", show_header=False)
            t.add_column()
            for item in items[:_LIST_LIMIT]:
                t.add_row(f"[{colour}]{'+' if colour == 'green' else '-'}[/] {plain(item)}")
            if len(items) > _LIST_LIMIT:
                t.add_row(f"... {len(items) - _LIST_LIMIT} more")
            parts.append(t)
    return Group(*parts)


@click.command("diff")
@click.argument("a_path", metavar="A.json")
@click.argument("b_path", metavar="B.json")
def diff_command(a_path: str, b_path: str) -> None:
    """Show what changed from plan A to plan B: mesh, training, layouts, stages, collectives, predictions."""
    from partita.compiler.console import console

    console.print(diff_table(diff_plans(load_plan(a_path), load_plan(b_path))))
