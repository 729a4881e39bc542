"""`partita demo`: plan the example GPT for `local`, train it on several gloo
processes under torchrun, and check the losses and final parameters against
the same training in one process.

The workers run ``python -m partita.compiler.demo PLAN OUT STEPS``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from partita.core.errors import PartitaError
from partita.core.options import Options

SEQ = 64
BATCH = 16
LR = 3e-3


def _examples() -> Any:
    """examples/models.py beside the package source (the demo runs from a checkout)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "models.py"
    if not path.is_file():
        raise PartitaError(f"the demo needs examples/models.py, not found at {path}",
                           hint="run `make demo` from a checkout of partita")
    spec = importlib.util.spec_from_file_location("partita_examples_models", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def demo_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _examples().gpt_tiny()


def demo_batches(steps: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token sequences counting up by a per-row stride (mod vocab): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % vocab
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in one process, whole batch at once, no partita."""
    from partita.core.model.losses import default_loss

    model = demo_model()
    opt = _optimizer(model.parameters())
    losses = []
    for x, y in demo_batches(steps, model.config.vocab_size):
        loss = default_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def worker(plan_path: str, out_path: str, steps: int) -> None:
    import partita

    model = partita.parallelize(demo_model(), plan=plan_path, optimizer=_optimizer)
    losses = []
    t0 = time.perf_counter()
    for x, y in demo_batches(steps, model.config.vocab_size):
        losses.append(model.train_step(x, targets=y))
    seconds = time.perf_counter() - t0
    if model.ctx.rank == 0:
        torch.save({k: v.detach().cpu() for k, v in model.module.state_dict().items()}, out_path + ".pt")
        Path(out_path).write_text(json.dumps({"losses": losses, "seconds": seconds,
                                              "world_size": model.ctx.world_size}))


def run_demo(*, nproc: int, steps: int, output: str, console: Any, progress: Any) -> None:
    from rich.table import Table

    from partita.compiler.compile import compile_model
    from partita.compiler.report import plain, plan_summary
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.runtime.processes.launch import run_torchrun

    if nproc < 1 or steps < 1:
        raise PartitaError(f"--nproc {nproc} and --steps {steps} must be positive",
                           hint="pass --nproc and --steps of at least 1")
    t_start = time.perf_counter()
    cluster = load_cluster("local", devices=nproc)
    with progress:
        options = Options(inputs=[parse_input_spec(f"idx=int64[{BATCH},{SEQ}]")], cluster=cluster, world_size=nproc)
        result = compile_model(demo_model, options, name="GPT (examples/models.py:gpt_tiny)", progress=progress)
        plan_path = result.plan.save(output)
        task = progress.add_task(f"training {steps} steps on {nproc} gloo processes", total=1)
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "losses.json")
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            rc = run_torchrun(nproc, ["-m", "partita.compiler.demo", str(plan_path), out, str(steps)], env=env)
            if rc != 0:
                raise PartitaError(f"the {nproc}-process run failed (exit code {rc}); see its output above",
                                   hint="the output above shows the failing rank's error")
            ran = json.loads(Path(out).read_text())
            parallel_state = torch.load(out + ".pt", weights_only=True)
        progress.update(task, completed=1)
        task = progress.add_task("training the same steps in one process", total=1)
        ref_losses, ref_state = reference(steps)
        progress.update(task, completed=1)
    console.print(plan_summary(result.plan))
    t = Table(title=f"losses: partita on {nproc} processes vs one process", title_justify="left")
    for col in ("step", f"partita ({result.plan.mesh})", "single process", "|difference|"):
        t.add_column(col, justify="right")
    for i, (a, b) in enumerate(zip(ran["losses"], ref_losses)):
        t.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}")
    console.print(t)
    loss_err = max(abs(a - b) for a, b in zip(ran["losses"], ref_losses))
    param_err = max((parallel_state[k] - v).abs().max().item() for k, v in ref_state.items())
    ok = loss_err < 1e-4 and param_err < 1e-4
    verdict = "[bold green]match[/]" if ok else "[bold red]MISMATCH[/]"
    console.print(f"{verdict}: max loss difference {loss_err:.2e}, max parameter difference {param_err:.2e} "
                  f"after {steps} steps; plan written to [bold]{plain(plan_path)}[/]; "
                  f"{time.perf_counter() - t_start:.1f} s in all")
    if not ok:
        raise PartitaError("the parallel run did not match the single-process run",
                           hint="this is a bug in partita: please report it with the output above")


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]))
