"""`partita calibrate`: measure this machine into a cluster file (CPU processes on gloo, or its GPUs),
or, with ``--router``, measure how a model's routers spread a real batch over their experts into a
router profile the planner prices expert parallelism by (``--expert-load``; core/experts.py)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import click
from rich.table import Table

from partita.compiler.console import console
from partita.compiler.console import progress_bar as _progress
from partita.compiler.flags import INT
from partita.compiler.report import plain
from partita.core.errors import PartitaError
from partita.core.files import writable_path, write_text, writes


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _calibrate_gpu(output: str) -> None:
    """`partita calibrate --device cuda`: runtime/calibrate.py ``calibrate_gpu`` into a cluster file."""
    import datetime

    from partita.compiler.report import fmt_bytes, fmt_time
    from partita.passes.calibrated import calibrated_gpu
    from partita.runtime.calibrate import calibrate_gpu

    writable_path(output)
    try:
        with _progress() as progress:
            task = progress.add_task("measuring GEMMs, memory, launches and NCCL on this machine's GPUs", total=1)
            r = calibrate_gpu()
            progress.update(task, completed=1)
    except RuntimeError as e:
        raise PartitaError(f"cannot calibrate a GPU: {e}", hint="pass --device cpu to measure CPU processes") from e
    spec = calibrated_gpu(r, date=datetime.date.today().isoformat())
    write_text(output, spec.to_toml())
    t = Table(title=f"calibration: {plain(r.device_name)} x {r.devices}", show_header=False, title_justify="left")
    t.add_row("GEMM efficiency (bf16, large)", f"{r.efficiency:.3f} of {r.peak_flops / 1e12:.0f} TFLOP/s "
              f"({plain(r.peak_source)})")
    t.add_row("per-kernel cost", fmt_time(r.kernel_s))
    for m, n, k, sec in r.gemm:
        t.add_row(f"  GEMM {m} x {n} x {k}", f"{2 * m * n * k / sec / 1e12:.0f} TFLOP/s")
    t.add_row("memory bandwidth (copy)", f"{fmt_bytes(r.hbm_bandwidth)}/s")
    t.add_row("elementwise ops reach", f"{r.memory_efficiency:.2f} of it")
    t.add_row("launching an op (host)", fmt_time(r.launch_s))
    t.add_row("attention efficiency", f"{r.attention_efficiency:.3f}")
    if r.allreduce_beta:
        t.add_row("NCCL all-reduce beta / alpha", f"{fmt_bytes(r.allreduce_beta)}/s / {fmt_time(r.allreduce_alpha)}")
    console.print(t)
    console.print(f"cluster file written to [bold]{plain(output)}[/]; use it with --cluster {plain(output)}")


def calibrated_cluster(r: Any) -> Any:
    """The cluster file's figures from a calibration (``runtime.calibrate.CalibrationResult``)."""
    from partita.passes.calibrated import calibrated_local

    return calibrated_local(nproc=r.nproc, cpu_name=r.cpu_name, memory_bytes=r.memory_bytes_per_process,
                            matmul_flops=r.matmul_flops, beta=r.allreduce_beta, alpha=r.allreduce_alpha,
                            call_seconds=r.call_seconds, call_bytes=r.call_bytes, seconds=r.seconds,
                            memory_bandwidth=r.memory_bandwidth, op_seconds=r.op_seconds)


@click.command()
@click.option("--nproc", type=INT, default=4, show_default=True, help="local processes to measure between")
@click.option("-o", "--output", metavar="PATH", default=None,
              help="where to write it  [default: local.toml; with --router, router.json]")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="what to measure: CPU processes on gloo, or this machine's GPUs (auto: cuda where torch sees one)")
@click.option("--router", "target", metavar="FILE.py:NAME", default=None,
              help="measure instead how this model's routers spread a batch over their experts (a router profile "
              "for compile's --expert-load)")
@click.option("--input", "inputs", metavar="NAME=DTYPE[SHAPE]", multiple=True,
              help="with --router: the batch's shape (random values) where --batch is not given")
@click.option("--batch", "batch_path", metavar="FILE.pt", default=None,
              help="with --router: a real batch, torch.save'd (a tensor, a tuple of them, or a dict by input name)")
@click.option("--weights", metavar="FILE", default=None,
              help="with --router: the trained weights (torch.save'd state dict or .safetensors) the routers use")
@writes("output")
def calibrate(nproc: int, output: str | None, device: str, target: str | None, inputs: tuple[str, ...],
              batch_path: str | None, weights: str | None) -> None:
    """Measure this machine into a cluster file: on CPU, matmul FLOP/s, memory bandwidth, gloo all-reduce
    bandwidth and latency and each collective's cost per call; on a GPU, GEMM efficiency by shape, memory
    bandwidth, the cost of launching an op, attention's efficiency and NCCL's collectives. With --router,
    a model's routing on a batch instead: each MoE layer's rows per expert, and the load they give."""
    from partita.runtime.calibrate import calibrate as measure

    if target is not None:
        _calibrate_router(target, inputs, batch_path, weights, output or "router.json")
        return
    if inputs or batch_path or weights:
        raise PartitaError("--input, --batch and --weights describe the model --router measures",
                           hint="add --router FILE.py:NAME, or drop them to calibrate the machine")
    output = output or "local.toml"

    if device == "cuda" or (device == "auto" and _cuda_available()):
        _calibrate_gpu(output)
        return
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
    t.add_row("per-kernel cost (host)", fmt_time(r.op_seconds))
    t.add_row("memory per process", fmt_bytes(r.memory_bytes_per_process))
    for kind, s in spec.call_latency.items():
        t.add_row(f"{kind} cost per call", f"{fmt_time(s)} (a {fmt_bytes(r.call_bytes)} call between matmuls "
                  f"added {fmt_time(r.call_seconds[kind])})")
    console.print(t)
    console.print(f"cluster file written to [bold]{plain(output)}[/]; use it with --cluster {plain(output)}")



def _calibrate_router(target: str, inputs: tuple[str, ...], batch_path: str | None, weights: str | None,
                      output: str) -> None:
    """`partita calibrate --router`: runtime/experts.py ``measure_routing`` into a router profile."""
    import torch

    from partita.compiler.loader import load_target
    from partita.core.experts import LOAD_HINT, rank_load, router_profile
    from partita.core.model.inputs import parse_input_spec
    from partita.runtime.experts import measure_routing
    from partita.runtime.state.weights import load_eager, open_weights

    writable_path(output)
    model = load_target(target)
    specs = [parse_input_spec(s) for s in inputs] or list(getattr(model.options, "inputs", ()) or ())
    specs = [parse_input_spec(s) if isinstance(s, str) else s for s in specs]
    if batch_path is None and not specs:
        raise PartitaError(f"{target} needs a batch to route", hint="pass --batch FILE.pt (a real batch), or "
                           "--input NAME=DTYPE[SHAPE] for random values of that shape")
    with _progress() as progress:
        task = progress.add_task(f"routing a batch through {model.name}", total=1)
        try:  # the user's code: its failure is one message
            module = model.factory()
        except Exception as e:
            raise PartitaError(f"building {model.name} failed: {type(e).__name__}: {e}",
                               hint=f"{target} must build the model with no arguments") from e
        if weights is not None:
            load_eager(module, open_weights(weights))
        args, said = _batch(batch_path, specs, module)
        try:
            counts = measure_routing(module, args)
        except Exception as e:
            raise PartitaError(f"{model.name} failed on the batch: {type(e).__name__}: {e}",
                               hint="pass the batch the model's forward takes (--batch, or --input shapes)") from e
        progress.update(task, completed=1)
    if not counts:
        raise PartitaError(f"{model.name} routed no rows to experts: it has no MoE layer partita finds (grouped "
                           "matmuls over parameters stacked by expert, core/experts.py)", hint=LOAD_HINT)
    tokens = math.prod(args[0].shape[:2]) if args and isinstance(args[0], torch.Tensor) else 0
    names = [f"MoE layer {i}" for i in range(len(counts))]
    text = json.dumps(router_profile(counts, tokens=tokens, model=f"{model.name}, {said}", layers=names), indent=1)
    write_text(output, re.sub(r"\[[\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n")
    t = Table(title=f"routing of {model.name} ({said})", title_justify="left")
    degrees = [e for e in range(2, len(counts[0]) + 1) if all(len(c) % e == 0 for c in counts)]
    for col in ["layer", "experts", "rows", "rows per expert (min-max)"] + [f"load at ep={e}" for e in degrees]:
        t.add_column(col, justify="left" if col == "layer" else "right")
    for name, c in zip(names, counts):
        t.add_row(name, str(len(c)), f"{sum(c):,}", f"{min(c):,}-{max(c):,}",
                  *(f"{rank_load(c, e):.2f}x" for e in degrees))
    console.print(t)
    console.print(f"router profile written to [bold]{plain(output)}[/]; plan with it: partita compile ... "
                  f"--expert-load {plain(output)}")


def _batch(path: str | None, specs: list[Any], module: Any) -> tuple[tuple[Any, ...], str]:
    """The batch to route, as the forward's positional arguments, and how it was made: ``path``'s
    (a tensor, a tuple or list of them, or a dict by input name in ``specs``' order), else random
    values of ``specs``' shapes (token ids below the smallest embedding's size)."""
    import torch

    if path is not None:
        from partita.core.files import check_regular_file

        hint = "torch.save a tensor, a tuple of tensors, or a dict of them by input name"
        check_regular_file(path, what="batch", hint=hint)
        try:
            data = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:
            raise PartitaError(f"cannot read the batch {path}: {e}", hint=hint) from e
        if isinstance(data, torch.Tensor):
            data = (data,)
        elif isinstance(data, dict):
            missing = [s.name for s in specs if s.name not in data]
            if not specs or missing:
                raise PartitaError(f"the batch {path} is a dict; its inputs' order needs --input NAME=... for each"
                                   + (f" (it has no {', '.join(missing)})" if missing else ""), hint=hint)
            data = tuple(data[s.name] for s in specs)
        if not isinstance(data, (tuple, list)) or not data or not all(isinstance(x, torch.Tensor) for x in data):
            raise PartitaError(f"the batch {path} holds a {type(data).__name__}, not tensors", hint=hint)
        return tuple(data), f"the batch {path}"
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, torch.nn.Embedding)]
    gen = torch.Generator().manual_seed(0)
    args = tuple(torch.randint(0, min(sizes, default=2), s.shape, generator=gen, dtype=s.dtype)
                 if not s.dtype.is_floating_point else torch.randn(s.shape, generator=gen, dtype=s.dtype)
                 for s in specs)
    return args, "random inputs " + " ".join(str(s) for s in specs)
