"""The `partita` command line.

    partita compile FILE.py:NAME --input idx=int64[16,64] --cluster local -o plan.json
    partita show plan.json
    partita estimate FILE.py:NAME|--params 7B [--dp 8] [--cluster dgx-a100] [--batch B]
    partita calibrate -o local.toml
    partita run plan.json train.py [ARGS...]
    partita demo

A user error (bad flag, untraceable model, infeasible budget, wrong plan
file) ends with one message on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
from rich.table import Table

from partita.compiler.commands.calibrate import calibrate
from partita.compiler.console import console, err_console
from partita.compiler.console import progress_bar as _progress
from partita.compiler.flags import FLOAT, INT, Endpoint, Number, verbose_flag
from partita.compiler.report import plain
from partita.compiler.run import NodeCount
from partita.core.errors import PartitaError
from partita.core.files import writable_path, writes
from partita.core.options import ALIASES, Options, flag_of, option_fields


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="partita")
def cli() -> None:
    """partita: plan how to train a PyTorch model across many devices, then run the plan."""


cli.add_command(calibrate)


def option_flags(command: str) -> Callable[[Any], Any]:
    """The flags of ``command`` made from the ``Options`` fields it offers (core/options.py): their
    names, help, types and choices come from the fields, so a new option is one field there."""
    def decorate(f: Any) -> Any:
        for fld in reversed(option_fields(command=command)):
            f = _flag(fld)(f)
            for alias, name in ALIASES.items():
                if name == fld.name:
                    f = click.option(f"--{alias}", alias, type=INT, default=None, hidden=True)(f)
        return f

    return decorate


def _flag(fld: Any) -> Any:
    m, flag = fld.metadata, flag_of(fld)
    if m["kind"] is bool:
        if fld.default is None:  # three ways: on, off, or (unset) the planner's choice
            return click.option(f"{flag}/--no-{flag[2:]}", fld.name, default=None, help=m["help"])
        return click.option(flag, fld.name, is_flag=True, default=None, help=m["help"])
    kind = click.Choice([str(c) for c in m["choices"]]) if m["choices"] else {int: INT, float: FLOAT}.get(
        m["kind"], m["kind"] or str)
    return click.option(flag, fld.name, type=kind, default=() if m["multiple"] else None, multiple=m["multiple"],
                        metavar=m["metavar"], help=m["help"])


def flag_options(values: dict[str, Any], base: Options | None = None) -> Options:
    """``base`` (a decorated target's options) with the option flags a user gave; a refusal is
    worded in flags (``--checkpoint-every``), as the user wrote them."""
    try:
        return Options.of(base, **_flag_values(values))
    except PartitaError as e:
        raise PartitaError(_in_flags(e.message), hint=_in_flags(e.hint) if e.hint else None) from None


def _in_flags(text: str) -> str:
    """A keyword's ``name=value`` as ``--flag value``, and a bare keyword name with an underscore
    (``checkpoint_dir``, unambiguous in prose) as its flag."""
    for fld in option_fields():
        if fld.metadata["flag"] is not None:
            text = re.sub(rf"(?<![\w-]){fld.name}=", f"{flag_of(fld)} ", text)
            if "_" in fld.name:
                text = re.sub(rf"(?<![\w-]){fld.name}(?![\w=])", flag_of(fld), text)
    return text


def _flag_values(values: dict[str, Any]) -> dict[str, Any]:
    """The option flags a user gave (not left at None), as ``Options`` keywords: ``--loss
    FILE.py:FN`` loaded as the function, a numeric ``--output-field`` as a tuple index."""
    given = {k: v for k, v in values.items() if v is not None and v != ()}
    loss = given.get("loss")
    if isinstance(loss, str) and ":" in loss and loss.split(":", 1)[0].endswith(".py"):
        from partita.compiler.loader import load_function

        given["loss"] = load_function(loss)
    out = given.get("output")
    if isinstance(out, str) and out.isascii() and out.lstrip("-").isdigit():
        given["output"] = int(out)
    return given


@cli.command("compile")
@click.argument("target")
@option_flags("compile")
@click.option("-o", "--output", "plan_path", metavar="PATH", default="plan.json", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON instead of tables")
@verbose_flag
@writes("plan_path")
def compile_cmd(target: str, plan_path: str, as_json: bool, **values: Any) -> None:
    """Capture TARGET (FILE.py:NAME), analyse it, and write a plan for the cluster."""
    from partita.compiler.compile import compile_model
    from partita.compiler.loader import load_target
    from partita.compiler.report import plan_report
    writable_path(plan_path)  # before the work, not after it
    model = load_target(target)
    options = flag_options(values, model.options)  # the flags over the decorator's keywords
    if not options.inputs:
        raise PartitaError(f"{target} needs example inputs",
                           hint="pass --input NAME=DTYPE[SHAPE], e.g. --input idx=int64[16,64]")
    with _progress() as progress:
        result = compile_model(model.factory, options, name=model.name, progress=progress)
    path = result.plan.save(plan_path)
    if as_json:
        click.echo(result.plan.to_json(), nl=False)
    else:
        console.print(plan_report(result.plan, params=False))
        console.print(f"plan written to [bold]{plain(path)}[/]")


@cli.command()
@click.argument("plan_path", metavar="PLAN.json")
@click.option("--json", "as_json", is_flag=True, help="print the validated plan as JSON")
def show(plan_path: str, as_json: bool) -> None:
    """Print a plan file for a person."""
    from partita.compiler.report import plan_report
    from partita.core.plans.verify import load_plan

    plan = load_plan(plan_path)
    if as_json:
        click.echo(plan.to_json(), nl=False)
    else:
        console.print(plan_report(plan))


@cli.command()
@click.argument("plan_path", metavar="PLAN.json")
@click.option("-o", "--output", metavar="PATH", default=None,
              help="write the sealed plan here (default: over PLAN.json)")
@writes("output", replaces=("plan_path",))
def verify(plan_path: str, output: str | None) -> None:
    """Run every check on a plan (edited by hand, say) and seal it again when all pass.

    A plan's seal (its sha256) is written by `partita compile`; loading refuses a plan whose seal
    does not match. This command re-derives what the plan's decisions imply, refuses any
    inconsistency, and only then writes the plan with a new seal."""
    from partita.core.plans.verify import load_plan

    plan = load_plan(plan_path, sealed=False)
    out = writable_path(output or plan_path)
    plan.save(out)
    console.print(f"{plain(plan_path)}: every check passed ({plan.mesh}, {len(plan.nodes)} node decisions, "
                  f"{len(plan.stages)} stage(s)); sealed plan written to {plain(out)}", highlight=False)


_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> int:
    """'7B', '65e9', '1.5M', '124000000' -> an integer count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMBGT]?)\s*", text, flags=re.IGNORECASE)
    hint = "e.g. --params 7B, 65e9 or 124M"
    if not m:
        raise PartitaError(f"--params {text!r} is not a parameter count", hint=hint)
    count = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(count) or count >= 1e18:
        raise PartitaError(f"--params {text!r} is not a finite parameter count (at most 1e18)", hint=hint)
    if count < 1:
        raise PartitaError(f"--params {text!r} must be at least 1", hint=hint)
    return int(count)


@cli.command()
@click.argument("target", required=False)
@click.option("--params", "params_text", default=None, help="a parameter count instead of a model, e.g. 65B")
@option_flags("estimate")
@click.option("--json", "as_json", is_flag=True)
@verbose_flag
def estimate(target: str | None, params_text: str | None, as_json: bool, **values: Any) -> None:
    """What fits: per-device memory of DP and ZeRO-1/2/3, and each one's traffic per step (--dp:
    the data-parallel degree, default every device)."""
    from partita.compiler.compile import default_precision
    from partita.compiler.report import fmt_bytes, fmt_count, fmt_time, memory_row
    from partita.core.precision import activation_scale, element_bytes
    from partita.passes.dp.zero import estimate_strategies

    if (target is None) == (params_text is None):
        raise PartitaError("give a model (FILE.py:NAME) or --params N, not both or neither",
                           hint="e.g. `partita estimate --params 7B` or `partita estimate FILE.py:NAME --input ...`")
    model = None
    if target is not None:
        from partita.compiler.loader import load_target

        model = load_target(target)
    options = flag_options(values, model.options if model else None)
    cluster = options.cluster_spec()
    options.pins().check_cluster(cluster.world_size)  # the words `partita compile` uses
    dp = options.dp or cluster.world_size
    precision = options.precision or default_precision(cluster)
    optimizer, inference, generate = options.optimizer_kind, options.inference, options.generate
    if generate and not inference:
        raise PartitaError("--generate needs --inference", hint="add --inference")
    note = ""
    if model is None:
        num_params, activations, name = parse_count(params_text), 0, "--params"
        note = "activations not counted: give a model and --input to include them"
    else:
        from partita.core.model.capture import capture
        from partita.passes.profile import profile_model

        if not options.inputs:
            raise PartitaError(f"{target} needs example inputs", hint="pass --input NAME=DTYPE[SHAPE]")
        with _progress() as progress:
            task = progress.add_task("capturing and analysing", total=1)
            # a training estimate captures the loss too: its transients are the step's largest
            profile = profile_model(capture(model.factory, options.inputs, name=model.name,
                                            loss=None if inference else options.loss, targets=options.targets))
            progress.update(task, completed=1)
        global_batch = options.batch if options.batch is not None else profile.batch_size
        if global_batch % dp:
            raise PartitaError(f"global batch {global_batch} does not divide over dp={dp}",
                               hint=f"use --batch a multiple of {dp} or a different --dp")
        mb = global_batch // dp
        held = profile.live_bytes(mb) if inference else profile.activation_bytes(mb)
        held += profile.kv_cache_bytes(mb, (profile.seq_len or 0) + generate) if generate else 0
        activations = int(held * activation_scale(precision, profile.param_dtype))
        num_params, name = profile.num_params, profile.name
        if not inference:  # what the step holds beyond the state and the saved activations, and the layers' sizes
            extra = _estimate_extras(profile, mb, precision, cluster.device)
            activations += extra.pop("autocast")
        note = (f"{'the forward' + chr(39) + 's largest live set' if inference else 'activations'} at micro-batch "
                f"{mb} per device (no accumulation)"
                + (f", plus the KV cache of {(profile.seq_len or 0) + generate} tokens" if generate else ""))
    rows = estimate_strategies(num_params, activations, cluster, dp=dp, precision=precision, optimizer=optimizer,
                               inference=inference, reduce_dtype=options.reduce_dtype,
                               **(extra if model is not None and not inference else {}))
    if as_json:
        click.echo(json.dumps({
            "model": name, "num_params": num_params, "cluster": cluster.name, "world_size": cluster.world_size,
            "dp": dp, "precision": precision, "optimizer": optimizer,
            "strategies": [{
                "name": r.name, "zero_stage": r.zero_stage, "model_states": r.memory.state,
                "params": r.memory.params, "grads": r.memory.grads,
                "optimizer": r.memory.optimizer, "activations": r.memory.activations, "total": r.memory.total,
                "capacity": r.memory.capacity, "fits": r.fits, "traffic_bytes": r.traffic_bytes, "comm_s": r.comm_s,
                "transient": r.memory.transient, "collectives": r.memory.collectives, "step": r.memory.step,
                "allocator": r.memory.allocator, "terms": dict(r.terms), "deepspeed": r.deepspeed,
                "left_out": dict(r.left_out),
            } for r in rows],
        }, indent=2))
        return
    t = Table(title=plain(f"what fits: {name} ({fmt_count(num_params)} params), {precision} {optimizer}, dp={dp} "
                          f"on {cluster.name} ({cluster.nodes}x{cluster.gpus_per_node} {cluster.device_name})"),
              title_justify="left")
    # the model states first, as the ZeRO paper tabulates them (16 bytes a parameter under mixed-precision
    # Adam, sharded by the stage), then each term the step adds to reach its peak
    for col in ("strategy", "model states", "params", "grads", "optimizer", "activations", "transient + buffers",
                "allocator", "total/device", "usable", "fits", "DeepSpeed's estimate", "traffic/step", "comm time"):
        t.add_column(col)
    for r in rows:
        m = r.memory
        cells = memory_row(m)
        t.add_row(r.name, fmt_bytes(m.state), *cells[:4], fmt_bytes(m.total - m.state - m.activations - m.allocator),
                  fmt_bytes(m.allocator), *cells[4:], "-" if r.deepspeed is None else fmt_bytes(r.deepspeed),
                  fmt_bytes(r.traffic_bytes), fmt_time(r.comm_s))
    console.print(t)
    console.print(f"[dim]{note}; at the step's peak: the state and the larger of the backward's side (activations, "
                  f"the costliest op's transient, ZeRO's buffers) and the optimizer step's (fp32 gradients); usable = "
                  f"{fmt_bytes(cluster.memory_bytes)} less {cluster.memory_reserve:.0%} reserve; traffic in "
                  f"{element_bytes(precision)}-byte elements[/]")
    for r in rows:
        counted = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.terms.items())
        left = ", ".join(k if v is None else f"{k} {fmt_bytes(v)}" for k, v in r.left_out.items())
        if counted or left:
            console.print(f"[dim]{r.name}: counted {counted or 'no runtime buffers'}"
                          + (f"; DeepSpeed's terms not counted: {left}" if left else "") + "[/]")


def _estimate_extras(profile: Any, micro_batch: int, precision: str, device: str) -> dict[str, Any]:
    """What `partita estimate` counts of a captured model beyond its saved activations: the costliest
    op's transient, autocast's fp32 copies, and the sizes the runtime's buffers and DeepSpeed's
    estimators go by (the largest parameter, the largest module's own parameters, ZeRO-3's largest
    unit: a repeated layer)."""
    from partita.core.buckets import unit_of
    from partita.passes.peak_memory import graph_autocast, graph_transient

    G = profile.graph
    args = dict(micro_batch=micro_batch, batch=profile.batch_size, precision=precision, device=device,
                captured=profile.param_dtype)
    params = {a["param_name"]: math.prod(a["shapes"][0]) for _, a in G.nodes(data=True) if a["kind"] == "param"}
    modules: dict[str, int] = {}
    units: dict[str, int] = {}
    layers = [layer for r in profile.repeated for layer in r.layers]
    for qual, n in params.items():
        modules[qual.rpartition(".")[0]] = modules.get(qual.rpartition(".")[0], 0) + n
        units[unit_of(qual, layers)] = units.get(unit_of(qual, layers), 0) + n
    return {"transient_bytes": round(graph_transient(G, **args)[0]), "autocast": round(graph_autocast(G, **args)),
            "largest_param": max(params.values(), default=0), "largest_layer": max(modules.values(), default=0),
            "unit_numel": max(units.values(), default=0), "tensors": G.graph.get("step_peak_tensors", 0)}



@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@option_flags("run")
@click.option("--max-restarts", type=Number(int, low=0), default=0, show_default=True,
              help="restart every rank this many times after one dies (torchrun's elastic restarts); "
              "with --checkpoint-dir the run resumes from its newest complete checkpoint")
@click.option("--nnodes", type=NodeCount(), default=None, metavar="N|MIN:MAX",
              help="nodes taking part (each runs `partita run` with the same plan); default: the plan's, or "
              "SLURM_NNODES under SLURM. MIN:MAX runs elastically: a lost node's survivors plan again for their "
              "own number and resume from the newest checkpoint; a node that comes back joins at the next one")
@click.option("--rejoin-wait", type=Number(float, low=0), default=None, metavar="SECONDS",
              help="with --nnodes MIN:MAX: after a node is lost, how long a restart waits for it before the "
              "survivors go on without it  [default: 30]")
@click.option("--node-rank", type=Number(int, low=0), default=None,
              help="this node's rank among --nnodes (node 0 hosts the rendezvous); default under SLURM: SLURM_NODEID")
@click.option("--rdzv-endpoint", type=Endpoint(), default=None, metavar="HOST:PORT",
              help="the c10d rendezvous every node joins (several nodes; default under SLURM: the first node:29500)")
@click.option("--standalone", is_flag=True, help="start every rank of a multi-node plan on this host")
@click.argument("plan_path", metavar="PLAN.json")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@writes("trace", "checkpoint_dir")
def run(max_restarts: int, nnodes: tuple[int, int] | None, rejoin_wait: float | None, node_rank: int | None,
        rdzv_endpoint: str | None, standalone: bool, plan_path: str, script: str, args: tuple[str, ...],
        **values: Any) -> None:
    """Launch SCRIPT under torchrun with one process per device of PLAN.json.

    The script's `partita.parallelize(...)` picks the plan up from the
    PARTITA_PLAN environment variable (and the trace path from PARTITA_TRACE);
    `partita view PLAN.json --trace TRACE.json` puts the measured schedule beside the predicted one.
    """
    from partita.compiler.run import start

    sys.exit(start(plan_path, script, args, lambda: flag_options(values), max_restarts=max_restarts, nnodes=nnodes,
                   rejoin_wait=rejoin_wait, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, standalone=standalone))


@cli.command()
@click.option("--nproc", type=Number(int, low=1), default=4, show_default=True)
@click.option("--steps", type=Number(int, low=1), default=5, show_default=True)
@click.option("-o", "--output", metavar="PATH", default="demo.plan.json", show_default=True)
@writes("output")
def demo(nproc: int, steps: int, output: str) -> None:
    """Plan the example GPT for `local`, train it on NPROC gloo processes, check against one process."""
    from partita.compiler.demo import run_demo

    run_demo(nproc=nproc, steps=steps, output=output, console=console, progress=_progress())


def _register_plan_readers() -> None:
    """`partita view` and `partita diff` live beside the page and the diff they make."""
    from partita.compiler.diff import diff_command
    from partita.compiler.view import view_command

    cli.add_command(view_command, "view")
    cli.add_command(diff_command, "diff")


_register_plan_readers()



def report_error(e: PartitaError) -> None:
    """The one way a user error is shown: its message and hint, each as plain text."""
    err_console.print(f"[bold red]error:[/] {plain(e.message)}", highlight=False, soft_wrap=True)
    if e.hint:
        err_console.print(f"  [yellow]hint:[/] {plain(e.hint)}", highlight=False, soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: user errors print one message and exit 2."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="partita", standalone_mode=False)
    except PartitaError as e:
        report_error(e)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx is not None else "partita"
        report_error(PartitaError(e.format_message(), hint=f"see `{command} --help`"))
        sys.exit(2)
    except click.ClickException as e:
        report_error(PartitaError(e.format_message(), hint="see `partita --help`"))
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
