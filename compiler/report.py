"""Rich tables a person reads: a plan (`partita show`, the compile summary) and the what-fits table."""

from __future__ import annotations

import math
from collections.abc import Iterable

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table

from partita.core.axes import axis_summary
from partita.core.axes.context import CP_SENDS
from partita.core.cluster import UNCALIBRATED
from partita.core.errors import printable
from partita.core.mesh import MeshAxis, held_experts, sequence_chunks
from partita.core.optimizers import NO_OFFLOAD
from partita.core.placement import REPLICATE, Placement, is_shard
from partita.core.plans.plan import MemoryBreakdown, Plan
from partita.core.recompute import FULL, NONE, RECOMPUTED, SELECTIVE
from partita.core.schedule import bubble_fraction


def plain(value: object) -> str:
    """``value`` as text for a Rich console: markup escaped (a ``[/]`` in a plan string or a path is
    text, not a tag) and control characters written as escapes (no terminal sequences). Every
    name that reaches the terminal (a model's, a cluster's, a module's, a path) goes through it."""
    return escape(printable(value))


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _kv(title: str, rows: Iterable[tuple[str, str]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", title_style="bold")
    t.add_column(style="cyan")
    t.add_column()
    for k, v in rows:
        t.add_row(k, plain(v))
    return t


CALIBRATE_HINT = ("these predictions use the `local` preset's rough defaults, not this machine's "
                  "figures; run `partita calibrate -o local.toml` and plan with `--cluster local.toml`")


def uncalibrated(plan: Plan) -> bool:
    """Whether ``plan`` was made for the `local` preset as shipped (its figures guessed, not measured)."""
    return plan.cluster.get("source") == UNCALIBRATED


def sources_of(plan: Plan) -> dict[str, str]:
    """Where each predicted figure comes from (``Prediction.sources``; a plan written before they were
    recorded names its cluster's source for all of them)."""
    if plan.predicted.sources:
        return dict(plan.predicted.sources)
    source = f"{plan.cluster.get('name', '?')}: {plan.cluster.get('source') or 'its cluster file'}"
    return {figure: source for figure in ("compute", "communication", "optimizer", "memory")}


def memory_terms(m: MemoryBreakdown) -> str:
    """The peak's terms in words: the state, then the backward's side or the optimizer step's, then
    the allocator's (core/plans/plan.py ``MemoryBreakdown``)."""
    grads = f"grads {fmt_bytes(m.grads)}" + (f" ({fmt_bytes(m.grads_at_peak)} made by the backward's peak)"
                                            if m.grads_at_peak < m.grads else "")
    parts = [f"params {fmt_bytes(m.params)}", grads, f"optimizer {fmt_bytes(m.optimizer)}"]
    if m.at_step:
        parts.append(f"at the optimizer step: fp32 gradients and buffers {fmt_bytes(m.step)}")
    else:
        parts.append(f"activations {fmt_bytes(m.activations)}"
                     + (f" (autocast's fp32 copies {fmt_bytes(m.autocast)})" if m.autocast else ""))
        terms = (("transient", m.transient), ("communication buffers", m.collectives))
        parts += [f"{name} {fmt_bytes(v)}" for name, v in terms if v]
    if m.allocator:
        parts.append(f"allocator {fmt_bytes(m.allocator)}")
    if m.host:
        parts.append(f"and in host memory (offload) the optimizer's state and masters {fmt_bytes(m.host)}")
    return ", ".join(parts)


def memory_row(m: MemoryBreakdown) -> list[str]:
    return [fmt_bytes(m.params), fmt_bytes(m.grads), fmt_bytes(m.optimizer), fmt_bytes(m.activations),
            fmt_bytes(m.total), fmt_bytes(m.capacity), "[green]yes[/]" if m.fits else "[red]no[/]"]


def _recompute_note(plan: Plan) -> str:
    """The training row's tail: sequence parallelism, offload, and each recomputation mode's stages."""
    notes = [", sequence parallel"] if plan.training.sequence_parallel else []
    if plan.training.offload != NO_OFFLOAD:
        notes.append(", optimizer state in host memory")
    for mode in (FULL, SELECTIVE):
        on = [s.index for s in plan.stages if s.recompute == mode]
        if on:
            where = "every stage" if len(on) == len(plan.stages) else f"stage(s) {', '.join(map(str, on))}"
            notes.append(f", {RECOMPUTED[mode]} recomputed on {where}")
    return "".join(notes)


BATCH = Placement("shard", 0)  # the batch dim


def tp_split(plan: Plan) -> dict[str, str] | None:
    """What the tp groups really do, when it is not tensor parallelism: every op that splits a
    tensor splits dim 0, the batch (``shard(0)``), so each rank of a group runs whole ops on its
    share of the samples. With sharded weights (gathered whole before each use) that is data
    parallelism with ZeRO-3's parameter sharding inside the group. None for real TP (an op split
    along another dim, or a partial sum) and for tp = 1. The header, `show` and `view` say it
    in these words, the mesh and the ZeRO stage."""
    if plan.mesh.tp <= 1:
        return None
    calls = [n for n in plan.nodes if n.op not in ("placeholder", "get_attr", "output")]
    outs = [Placement.parse(o) for n in calls for o in n.out]
    if not any(o.kind != REPLICATE for o in outs) or any(o.kind != REPLICATE and o != BATCH for o in outs):
        return None
    sharded = any(p.layout.get("tp", REPLICATE) != REPLICATE for p in plan.params)
    tp, dp = plan.mesh.tp, plan.mesh.dp
    return {
        "mesh": f"data parallelism over {dp * tp} = dp {dp} x tp {tp}: the tp groups split the batch "
                "(shard(0) on every op), not the ops" + (", and shard the weights" if sharded else ""),
        "zero": (f"ZeRO-{plan.training.zero_stage} over dp {dp}"
                 + (f"; inside each tp group of {tp} the weights are sharded and all-gathered before each use "
                    "(ZeRO-3's parameter sharding)" if sharded else f"; weights replicated over tp {tp}")),
    }


def expert_layout(plan: Plan) -> dict | None:
    """Where an ep > 1 plan's experts live (None at ep = 1): its MoE layers (the modules of the
    parameters sharded over "ep", each with its experts ``E``), the expert groups (core/mesh.py
    ``Mesh.groups("ep")``) and per rank the experts it holds of each layer, ``[i E/ep, (i + 1) E/ep)``
    for its place i in its group (of the layers on its pipeline stage), and the ranks holding the
    same experts ("edp"). The report and `partita view` show it."""
    m = plan.mesh
    if m.ep <= 1:
        return None
    layers: dict[str, int] = {}
    stage: dict[str, int] = {}  # layer -> the pipeline stage holding it
    for p in plan.params:
        if is_shard(p.layout.get(MeshAxis.EP.value, REPLICATE)):
            layers.setdefault(p.name.rpartition(".")[0], p.shape[0])
            stage.setdefault(p.name.rpartition(".")[0], p.stage % m.pp)
    ranks = []
    for r in range(plan.world_size):
        i = m.ep_rank(r)
        ranks.append({"rank": r, "group": list(m.group_ranks(r, MeshAxis.EP.value)),
                      "edp": list(m.group_ranks(r, MeshAxis.EDP.value)),
                      "experts": {name: [held_experts(e, m.ep, i)[0], held_experts(e, m.ep, i)[-1]]
                                  for name, e in layers.items() if stage[name] == m.stage_of(r)}})
    return {"ep": m.ep, "layers": [{"module": name, "experts": e, "per_rank": e // m.ep} for name, e in layers.items()],
            "groups": [list(g) for g in m.groups(MeshAxis.EP.value)], "ranks": ranks, "staged": m.pp > 1}


def _held(experts: dict[str, list[int]], staged: bool = False) -> str:
    """The experts a rank holds, in words: one range when every layer (of its pipeline stage, where
    ``staged``) gives it the same ones."""
    spans = {f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in experts.values()}
    if not spans:
        return "no MoE layer on its stage"
    if len(spans) == 1:
        return f"experts {spans.pop()} of every MoE layer" + (" on its stage" if staged else "")
    return "; ".join(f"{name}: {lo}-{hi}" for name, (lo, hi) in experts.items())


def experts_table(plan: Plan) -> Table | None:
    """An ep > 1 plan's expert groups: which ranks form each, the experts each rank holds and the
    ranks it averages those experts' gradients with (``expert_layout``); None at ep = 1."""
    lay = expert_layout(plan)
    if lay is None:
        return None
    modules = ", ".join(f"{x['module']} ({x['experts']} experts)" for x in lay["layers"])
    per = sorted({x["per_rank"] for x in lay["layers"]})
    t = Table(title=f"expert parallelism (ep={lay['ep']}): {len(lay['layers'])} MoE layer(s), "
                    f"{'/'.join(map(str, per))} expert(s) per rank: {modules}",
              title_justify="left", title_style="bold")
    for col in ("expert group", "rank", "holds", "gradients averaged with (edp)"):
        t.add_column(col)
    for g, ranks in enumerate(lay["groups"]):
        for r in ranks:
            row = lay["ranks"][r]
            t.add_row(f"{g}: ranks {', '.join(map(str, ranks))}" if r == ranks[0] else "", str(r),
                      plain(_held(row["experts"], lay["staged"])), ", ".join(map(str, row["edp"])))
    return t


def context_table(plan: Plan, limit: int = 8) -> Table | None:
    """A cp > 1 plan's context-parallel groups (core/mesh.py ``Mesh.groups("cp")``): which ranks share
    each sequence, the two mirrored chunks of it each holds (``sequence_chunks``), the attention
    strategy and why the planner split the sequence (its note); None at cp = 1."""
    m = plan.mesh
    if m.cp <= 1:
        return None
    why = next((n for n in plan.solver.notes if n.startswith(("context parallelism", f"cp={m.cp}"))), "")
    t = Table(title=f"context parallelism (cp={m.cp}): attention by {plan.training.cp_attention} "
                    f"({CP_SENDS[plan.training.cp_attention]})" + (f"; {why}" if why else ""),
              title_justify="left", title_style="bold")
    for col in ("cp group", "rank", "holds of each sequence (chunks of 2 x cp)"):
        t.add_column(col)
    groups = m.groups(MeshAxis.CP.value)
    for g, ranks in enumerate(groups[:limit]):
        for r in ranks:
            a, b = sequence_chunks(m.cp, m.cp_rank(r))
            t.add_row(f"{g}: ranks {', '.join(map(str, ranks))}" if r == ranks[0] else "", str(r),
                      f"chunks {a} and {b} of {2 * m.cp}")
    if len(groups) > limit:
        t.add_row(f"... {len(groups) - limit} more groups", "", "")
    return t


def plan_summary(plan: Plan) -> RenderableType:
    """The compile summary and the head of `partita show`."""
    m, t, p, c = plan.model, plan.training, plan.predicted, plan.cluster
    comm = ", ".join(f"{k} {fmt_time(v)}" for k, v in p.comm_s.items()) or "none"
    rows = [
        ("model", f"{m.name}: {fmt_count(m.num_params)} params, {m.num_nodes} graph nodes ({m.capture_method})"),
        ("inputs", ", ".join(m.inputs)),
        ("cluster", f"{c['name']}: {c['nodes']} node(s) x {c['gpus_per_node']} {c.get('device_name', '')}"),
        ("mesh", f"{plan.mesh} = {plan.world_size} device(s)"),
        ("batch", f"global {t.global_batch} = "
                  + (f"dp {plan.mesh.dp} / cp {plan.mesh.cp}" if plan.mesh.cp > 1 else f"dp {plan.mesh.dp}")
                  + f" x micro-batch {t.micro_batch_size} "
                  f"x {t.grad_accum_steps} accumulation step(s)"),
        ("training", f"{t.precision}, {t.optimizer}, ZeRO-{t.zero_stage}"
                     + (", inference" if t.inference else "") + _recompute_note(plan)),
        ("step time", f"{fmt_time(p.step_time_s)} = compute {fmt_time(p.compute_s)} + comm ({comm}) "
                      f"+ optimizer {fmt_time(p.optimizer_s)}"),
        ("throughput", f"{p.samples_per_s:,.1f} samples/s"
                       + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else "")
                       + f", {p.model_tflops_per_device:.3g} model TFLOP/s per device, MFU {p.mfu:.1%}"),
        ("memory/device", f"{fmt_bytes(p.memory.total)} of {fmt_bytes(p.memory.capacity)} usable at the step's peak "
                          f"({memory_terms(p.memory)})"),
        ("traffic/device", ", ".join(f"{k} {fmt_bytes(v)}/step" for k, v in p.traffic_bytes.items()) or "none"),
        ("solver", f"{plan.solver.method}: {plan.solver.status}, {plan.solver.candidates} candidates, "
                   f"{fmt_time(plan.solver.seconds)}"),
        ("fingerprint", m.fingerprint),
    ]
    honest = tp_split(plan)
    if honest:
        rows[3] = ("mesh", f"{plan.mesh} = {plan.world_size} device(s): {honest['mesh']}")
        rows[5] = ("training", f"{t.precision}, {t.optimizer}, {honest['zero']}"
                   + (", inference" if t.inference else "") + _recompute_note(plan))
    # every predicted figure names where it comes from, before the fingerprint
    rows[-1:-1] = [(f"source: {figure}", text) for figure, text in sources_of(plan).items()]
    if m.repeated_layers:
        rows.insert(1, ("repeated", "; ".join(m.repeated_layers)))
    if uncalibrated(plan):
        rows.insert(0, ("[bold yellow]uncalibrated[/]", CALIBRATE_HINT))
    return _kv("partita plan", rows)


def axes_table(plan: Plan) -> Table:
    """Every parallelism axis of the registry (core/axes) and what the plan decided on it."""
    t = Table(title="axes", title_justify="left", title_style="bold")
    t.add_column("axis")
    t.add_column("decided")
    for name, decided in axis_summary(plan):
        t.add_row(name, plain(decided) if decided else "[dim]off[/]", style="" if decided else "dim")
    return t


def alternatives_table(plan: Plan) -> Table:
    t = Table(title="alternatives weighed", title_justify="left", title_style="bold")
    for col in ("mesh", "micro-batch", "accum", "ZeRO", "step time", "memory/device", "why"):
        t.add_column(col)
    for a in plan.alternatives:
        style = "bold green" if a.chosen else ("red" if not a.fits else "")
        unsolved = not a.fits and a.step_time_s is None and not a.memory_bytes  # pruned: its reason says why
        t.add_row(str(a.mesh), str(a.micro_batch_size), str(a.grad_accum_steps), str(a.zero_stage),
                  fmt_time(a.step_time_s),
                  "-" if unsolved else fmt_bytes(a.memory_bytes), plain(a.reason), style=style)
    return t


def collectives_table(plan: Plan) -> Table:
    t = Table(title="collectives per step (each rank)", title_justify="left", title_style="bold")
    staged = plan.mesh.pp > 1
    for col in ("stage",) * staged + ("kind", "axis", "group", "bytes/call", "calls", "time", "purpose"):
        t.add_column(col)
    for c in plan.collectives:
        head = ("all" if c.stage is None else str(c.stage),) * staged
        t.add_row(*head, plain(c.kind), plain(c.axis), str(c.group_size), fmt_bytes(c.bytes), str(c.count),
                  fmt_time(c.seconds), plain(c.purpose))
    return t


def stages_table(plan: Plan) -> Table:
    """The pipeline stages and the predicted schedule."""
    t = plan.training
    p, v = plan.mesh.pp, t.chunks
    shape = f"{len(plan.stages)} stages" if v == 1 else f"{len(plan.stages)} virtual stages ({v} per rank)"
    formula = "(p-1)/m" if v == 1 else "(p-1)/(v m)"
    title = (f"pipeline: {shape}, {t.schedule}, {t.grad_accum_steps} micro-batches of "
             f"{t.micro_batch_size}; bubble {formula} = {bubble_fraction(p, t.grad_accum_steps, v):.1%}")
    table = Table(title=title, title_justify="left", title_style="bold")
    for col in ("stage", "ranks", "holds", "params", "forward", "backward", "busy/step", "memory/device",
                "sends/micro-batch"):
        table.add_column(col)
    for s in plan.stages:
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else ",".join(map(str, s.ranks))
        backward = fmt_time(s.backward_s) + (f" (recomputes {s.recompute})" if s.recompute != NONE else "")
        table.add_row(str(s.index), ranks, plain(", ".join(s.modules) or f"{s.first_node} .. {s.last_node}"),
                      fmt_count(s.params), fmt_time(s.forward_s), backward,
                      fmt_time(s.predicted_time_s), fmt_bytes(s.memory_bytes), fmt_bytes(s.send_bytes))
    return table


def tp_layout_table(plan: Plan, limit: int = 30) -> Table:
    """Which modules are column-, row- or vocabulary-split: each parameterised op's strategy, by module."""
    t = Table(title=f"tensor-parallel layout (tp={plan.mesh.tp})", title_justify="left", title_style="bold")
    for col in ("module", "op", "split", "inserted collectives (forward / backward)"):
        t.add_column(col)
    seen: dict[tuple[str, str], list] = {}
    for n in plan.nodes:
        if n.strategy == "replicate" and not any(i.fwd not in ("none", "slice") or i.bwd not in ("none", "slice")
                                                 for i in n.ins):
            continue
        if n.op in ("placeholder", "output"):
            continue
        key = (n.module or "<root>", n.op.removeprefix("aten.").split(".")[0])
        seen.setdefault(key, []).append(n)
    for i, ((module, op), ns) in enumerate(seen.items()):
        if i == limit:
            t.add_row(f"... {len(seen) - limit} more", "", "", "")
            break
        colls = sorted({f"{x.fwd}" for n in ns for x in n.ins if x.fwd not in ("none", "slice")})
        bcolls = sorted({f"{x.bwd}" for n in ns for x in n.ins if x.bwd not in ("none", "slice")})
        t.add_row(plain(module), plain(op), plain(", ".join(sorted({n.strategy for n in ns}))),
                  f"{', '.join(colls) or '-'} / {', '.join(bcolls) or '-'}")
    return t


def params_table(plan: Plan, limit: int = 40) -> Table:
    """Parameters grouped by module, with their layout on each mesh axis."""
    t = Table(title="parameters by module", title_justify="left", title_style="bold")
    for col in ("module", "params", "elements", "layout", "stage"):
        t.add_column(col)
    groups: dict[str, list] = {}
    for p in plan.params:
        groups.setdefault(p.name.rpartition(".")[0] or "(root)", []).append(p)
    for i, (mod, ps) in enumerate(groups.items()):
        if i == limit:
            t.add_row(f"... {len(groups) - limit} more modules", "", "", "", "")
            break
        n = sum(math.prod(p.shape) for p in ps)
        layouts = sorted({", ".join(f"{k}={v}" for k, v in p.layout.items()) for p in ps})
        t.add_row(plain(mod), plain(", ".join(p.name.rpartition(".")[2] for p in ps)), fmt_count(n),
                  plain("; ".join(layouts)),
                  ", ".join(sorted({str(p.stage) for p in ps})))
    return t


def plan_report(plan: Plan, *, params: bool = True) -> RenderableType:
    parts: list[RenderableType] = [plan_summary(plan), axes_table(plan)]
    if len(plan.stages) > 1:
        parts.append(stages_table(plan))
    if plan.mesh.tp > 1 and plan.nodes:
        parts.append(tp_layout_table(plan))
    if plan.mesh.ep > 1:
        parts.append(experts_table(plan))
    if plan.mesh.cp > 1:
        parts.append(context_table(plan))
    if plan.collectives:
        parts.append(collectives_table(plan))
    if plan.alternatives:
        parts.append(alternatives_table(plan))
    if params and plan.params:
        parts.append(params_table(plan))
    return Group(*parts)
