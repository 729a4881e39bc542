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
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from partita.compiler.console import console, err_console
from partita.compiler.report import plain
from partita.core.errors import PartitaError, writable_path, write_text
from partita.core.options import ALIASES, RUN, Options, flag_of, option_fields


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="partita")
def cli() -> None:
    """partita: plan how to train a PyTorch model across many devices, then run the plan."""


def option_flags(command: str) -> Callable[[Any], Any]:
    """The flags of ``command`` made from the ``Options`` fields it offers (core/options.py): their
    names, help, types and choices come from the fields, so a new option is one field there."""
    def decorate(f: Any) -> Any:
        for fld in reversed(option_fields(command=command)):
            f = _flag(fld)(f)
            for alias, name in ALIASES.items():
                if name == fld.name:
                    f = click.option(f"--{alias}", alias, type=int, default=None, hidden=True)(f)
        return f

    return decorate


def _flag(fld: Any) -> Any:
    m, flag = fld.metadata, flag_of(fld)
    if m["kind"] is bool:
        if fld.default is None:  # three ways: on, off, or (unset) the planner's choice
            return click.option(f"{flag}/--no-{flag[2:]}", fld.name, default=None, help=m["help"])
        return click.option(flag, fld.name, is_flag=True, default=None, help=m["help"])
    kind = click.Choice([str(c) for c in m["choices"]]) if m["choices"] else (m["kind"] or str)
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
    if isinstance(out, str) and out.lstrip("-").isdigit():
        given["output"] = int(out)
    return given


@cli.command("compile")
@click.argument("target")
@option_flags("compile")
@click.option("-o", "--output", "plan_path", metavar="PATH", default="plan.json", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON instead of tables")
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
    from partita.core.verify import load_plan

    plan = load_plan(plan_path)
    if as_json:
        click.echo(plan.to_json(), nl=False)
    else:
        console.print(plan_report(plan))


@cli.command()
@click.argument("plan_path", metavar="PLAN.json")
@click.option("-o", "--output", metavar="PATH", default=None,
              help="write the sealed plan here (default: over PLAN.json)")
def verify(plan_path: str, output: str | None) -> None:
    """Run every check on a plan (edited by hand, say) and seal it again when all pass.

    A plan's seal (its sha256) is written by `partita compile`; loading refuses a plan whose seal
    does not match. This command re-derives what the plan's decisions imply, refuses any
    inconsistency, and only then writes the plan with a new seal."""
    from partita.core.verify import load_plan

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
        from partita.core.capture import capture
        from partita.passes.profile import profile_model

        if not options.inputs:
            raise PartitaError(f"{target} needs example inputs", hint="pass --input NAME=DTYPE[SHAPE]")
        with _progress() as progress:
            task = progress.add_task("capturing and analysing", total=1)
            profile = profile_model(capture(model.factory, options.inputs, name=model.name))
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
        note = (f"{'the forward' + chr(39) + 's largest live set' if inference else 'activations'} at micro-batch "
                f"{mb} per device (no accumulation)"
                + (f", plus the KV cache of {(profile.seq_len or 0) + generate} tokens" if generate else ""))
    rows = estimate_strategies(num_params, activations, cluster, dp=dp, precision=precision, optimizer=optimizer,
                               inference=inference)
    if as_json:
        click.echo(json.dumps({
            "model": name, "num_params": num_params, "cluster": cluster.name, "world_size": cluster.world_size,
            "dp": dp, "precision": precision, "optimizer": optimizer,
            "strategies": [{
                "name": r.name, "zero_stage": r.zero_stage, "params": r.memory.params, "grads": r.memory.grads,
                "optimizer": r.memory.optimizer, "activations": r.memory.activations, "total": r.memory.total,
                "capacity": r.memory.capacity, "fits": r.fits, "traffic_bytes": r.traffic_bytes, "comm_s": r.comm_s,
            } for r in rows],
        }, indent=2))
        return
    t = Table(title=f"what fits: {name} ({fmt_count(num_params)} params), {precision} {optimizer}, "
                    f"dp={dp} on {cluster.name} ({cluster.nodes}x{cluster.gpus_per_node} {cluster.device_name})",
              title_justify="left")
    for col in ("strategy", "params", "grads", "optimizer", "activations", "total/device", "usable", "fits",
                "traffic/step", "comm time"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.name, *memory_row(r.memory), fmt_bytes(r.traffic_bytes), fmt_time(r.comm_s))
    console.print(t)
    console.print(f"[dim]{note}; usable = {fmt_bytes(cluster.memory_bytes)} less "
                  f"{cluster.memory_reserve:.0%} reserve; traffic in {element_bytes(precision)}-byte elements[/]")


def calibrated_cluster(r: Any) -> Any:
    """The cluster file's figures from a calibration (``runtime.calibrate.CalibrationResult``)."""
    from partita.passes.cost_model import calibrated_local

    return calibrated_local(nproc=r.nproc, cpu_name=r.cpu_name, memory_bytes=r.memory_bytes_per_process,
                            matmul_flops=r.matmul_flops, beta=r.allreduce_beta, alpha=r.allreduce_alpha,
                            call_seconds=r.call_seconds, call_bytes=r.call_bytes, seconds=r.seconds,
                            memory_bandwidth=r.memory_bandwidth)


@cli.command()
@click.option("--nproc", type=int, default=4, show_default=True, help="local processes to measure between")
@click.option("-o", "--output", metavar="PATH", default="local.toml", show_default=True)
def calibrate(nproc: int, output: str) -> None:
    """Measure this machine (matmul FLOP/s, memory bandwidth, gloo all-reduce bandwidth and latency,
    each collective's cost per call) into a cluster file."""
    from partita.runtime.calibrate import calibrate as measure

    if nproc < 2:
        raise PartitaError(f"--nproc {nproc}: calibration needs at least 2 processes",
                           hint="pass --nproc 2 or more (one per device it measures between)")
    writable_path(output)
    with _progress() as progress:
        task = progress.add_task(f"measuring matmul and gloo all-reduce on {nproc} processes", total=1)
        r = measure(nproc)
        progress.update(task, completed=1)
    spec = calibrated_cluster(r)
    write_text(output, spec.to_toml())
    from partita.compiler.report import fmt_bytes, fmt_time

    t = Table(title="calibration", show_header=False, title_justify="left")
    t.add_row("matmul (fp32, per process)", f"{r.matmul_flops / 1e9:.1f} GFLOP/s")
    t.add_row("all-reduce bandwidth (beta)", f"{fmt_bytes(r.allreduce_beta)}/s")
    t.add_row("all-reduce latency (alpha)", fmt_time(r.allreduce_alpha))
    t.add_row("memory bandwidth (copy, per process)", f"{fmt_bytes(r.memory_bandwidth)}/s")
    t.add_row("memory per process", fmt_bytes(r.memory_bytes_per_process))
    for kind, s in spec.call_latency.items():
        t.add_row(f"{kind} cost per call", f"{fmt_time(s)} (a {fmt_bytes(r.call_bytes)} call between matmuls "
                  f"added {fmt_time(r.call_seconds[kind])})")
    console.print(t)
    console.print(f"cluster file written to [bold]{plain(output)}[/]; use it with --cluster {plain(output)}")


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@option_flags("run")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="restart every rank this many times after one dies (torchrun's elastic restarts); "
              "with --checkpoint-dir the run resumes from its newest complete checkpoint")
@click.option("--nnodes", type=click.IntRange(min=1), default=None,
              help="nodes taking part (each runs `partita run` with the same plan); default: the plan's, or "
              "SLURM_NNODES under SLURM")
@click.option("--node-rank", type=click.IntRange(min=0), default=None,
              help="this node's rank among --nnodes (node 0 hosts the rendezvous); default under SLURM: SLURM_NODEID")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
              help="the c10d rendezvous every node joins (several nodes; default under SLURM: the first node:29500)")
@click.option("--standalone", is_flag=True, help="start every rank of a multi-node plan on this host")
@click.argument("plan_path", metavar="PLAN.json")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(max_restarts: int, nnodes: int | None, node_rank: int | None, rdzv_endpoint: str | None,
        standalone: bool, plan_path: str, script: str, args: tuple[str, ...], **values: Any) -> None:
    """Launch SCRIPT under torchrun with one process per device of PLAN.json.

    The script's `partita.parallelize(...)` picks the plan up from the
    PARTITA_PLAN environment variable (and the trace path from PARTITA_TRACE);
    `partita view PLAN.json --trace TRACE.json` puts the measured schedule beside the predicted one.
    """
    import os

    from partita.core.verify import load_plan
    from partita.runtime.engine import refuse_unsupported
    from partita.runtime.launch import launch, slurm_layout

    plan = load_plan(plan_path)
    refuse_unsupported(plan)  # once, here, before any process starts
    if not Path(script).is_file():
        raise PartitaError(f"script {script} does not exist",
                           hint="pass the training script that calls partita.parallelize(...), then its arguments")
    slurm = slurm_layout()
    planned_nodes = int(plan.cluster.get("nodes", 1)) if plan.cluster.get("device") != "cpu" else 1
    nodes = nnodes or (slurm.nnodes if slurm else 1)
    if standalone and nnodes not in (None, 1):
        raise PartitaError(f"--standalone starts every rank on this host, but --nnodes {nnodes} spreads them "
                           f"over {nnodes} nodes", hint="drop one of --standalone and --nnodes")
    if standalone:
        nodes = 1
    elif nnodes is None and slurm is None and planned_nodes > 1:
        raise PartitaError(
            f"this plan is for {planned_nodes} nodes of {plan.world_size // planned_nodes} devices; starting all "
            f"{plan.world_size} processes on this host is not what it was planned for",
            hint=f"run `partita run --nnodes {planned_nodes} --node-rank R --rdzv-endpoint HOST:PORT {plan_path} "
            f"{script}` on every node (under SLURM they are filled in), or pass --standalone to start them all here")
    if plan.world_size % nodes:
        raise PartitaError(f"--nnodes {nodes} does not divide the plan's {plan.world_size} ranks",
                           hint="pass a number of nodes that divides the plan's ranks, or recompile for these nodes")
    endpoint = rdzv_endpoint or (slurm.rdzv_endpoint if slurm and nodes > 1 else None)
    if nodes > 1 and endpoint is None:
        raise PartitaError(f"{nodes} nodes need a rendezvous every node can reach",
                           hint="pass --rdzv-endpoint HOST:PORT (the same on every node)")
    # the run options reach every rank through the environment, checked here as the decorator checks them
    options = flag_options(values)
    env = dict(os.environ, PARTITA_PLAN=str(Path(plan_path).resolve()))
    for fld in option_fields(RUN, command="run"):
        value = getattr(options, fld.name)
        if value is not None:
            env[fld.metadata["env"]] = str(Path(value).resolve()) if fld.metadata["path"] else f"{value:g}" \
                if isinstance(value, float) else str(value)
    rank = node_rank if node_rank is not None else (slurm.node_rank if slurm else None)
    if nodes > 1 and rank is None:
        raise PartitaError(f"{nodes} nodes: which one is this?", hint="pass --node-rank R (0 on the node that "
                           "hosts the rendezvous, 1 to N-1 on the others)")
    if rank is not None and rank >= nodes:
        raise PartitaError(f"--node-rank {rank} is not below --nnodes {nodes}",
                           hint="node ranks run from 0 to --nnodes minus 1")
    sys.exit(launch(plan.world_size // nodes, [script, *args], env=env, max_restarts=max_restarts, nnodes=nodes,
                    rdzv_endpoint=endpoint, run_id=slurm.run_id if slurm else None, node_rank=rank))


@cli.command()
@click.option("--nproc", type=int, default=4, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True)
@click.option("-o", "--output", metavar="PATH", default="demo.plan.json", show_default=True)
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
