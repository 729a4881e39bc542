"""What each rank of the plan-matrix test measures (test_plan_matrix.py asserts it).

Every small example model is compiled by the planner under each set of the
CLI's pins (``compile_model`` with ``Pins``, as ``partita compile`` does), and
every plan the planner writes is run for one training step: its loss beside a
single-process reference's on the same global batch, ``evaluate`` in eval mode
beside the reference's eval-mode loss (before the step), and how far the parameters
after the step (``full_state_dict``: SGD with momentum, so they move by the gradients
themselves) are from the reference's, and how far the step moved those.

Two launches share ``outdir``. In the first (2 ranks) each rank compiles half
of the cases, writes each plan (or the planner's refusal) to
``outdir/plans/CASE.json``, and then every rank runs each 2-device plan; the
second (4 ranks) runs the 4-device plans. A plan the planner refuses
(``PartitaError``: an infeasible or contradictory pin) is reported and skipped;
anything that fails while running a plan fails the launch, naming the case.
"""

from __future__ import annotations

import copy
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from examples.models import MLP, SmallCNN, gpt_tiny
from partita.core.errors import PartitaError
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.plans.verify import load_plan
from partita.runtime.distributed import DistContext
from partita.runtime.engine import ParallelModel
from tests.harness import gaps, max_abs_diff, reference_step
from tests.workers.dp_worker import OPTIMIZERS, gpt_batch
from tests.workers.tp_worker import hf_gpt2_tiny, hf_llama_tiny


def mlp4() -> MLP:
    """Four equal 1024-wide layers: one repeated block whose first layer reads the model input (issue 16)."""
    return MLP(d_in=1024, hidden=1024, d_out=1024, layers=4)


def _classes(n: int, rows: int, extra: tuple[int, ...]) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return torch.randn(global_batch, *extra, generator=g), torch.randint(0, n, (global_batch,), generator=g)
    return batch


# name -> (factory, input spec at the global batch, batch(global_batch) -> (inputs, targets))
MODELS: dict[str, tuple[Callable, str, Callable]] = {
    "mlp": (mlp4, "x=float32[128,1024]", _classes(1024, 128, (1024,))),
    "cnn": (SmallCNN, "x=float32[16,3,32,32]", _classes(10, 16, (3, 32, 32))),
    "gpt": (gpt_tiny, "idx=int64[8,16]", gpt_batch),
    "hf-gpt2": (hf_gpt2_tiny, "input_ids=int64[8,16]", gpt_batch),
    "hf-llama": (hf_llama_tiny, "input_ids=int64[8,16]", gpt_batch),
}

# label -> the CLI's pins (keyword names of core.options.Options)
PINS_2: dict[str, dict] = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "pp2-gpipe": dict(pp=2, schedule="gpipe"),
    "pp2-1f1b": dict(pp=2, schedule="1f1b"),
    "pp2-interleaved": dict(pp=2, schedule="interleaved-1f1b"),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero2": dict(dp=2, zero=2),
    "dp2-zero3": dict(dp=2, zero=3),
    "tp2-recompute": dict(tp=2, recompute=True),
    "pp2-recompute": dict(pp=2, recompute=True),
    "pp2-selective": dict(pp=2, recompute="selective"),  # the MLP and the CNN have no attention: refused
    "dp2-zero1-offload": dict(dp=2, zero=1, offload="optimizer"),
}
PINS_4: dict[str, dict] = {
    "dp2xtp2-zero2": dict(dp=2, tp=2, zero=2),
    "tp2xpp2-1f1b-recompute": dict(tp=2, pp=2, schedule="1f1b", recompute=True),
    "dp2xpp2-gpipe-zero1": dict(dp=2, pp=2, schedule="gpipe", zero=1),
    "dp2xpp2-interleaved": dict(dp=2, pp=2, schedule="interleaved-1f1b"),
    "dp2xtp2-sp": dict(dp=2, tp=2, sequence_parallel=True),  # the MLP has no residual stream: refused
}
MODELS_4 = ("mlp", "gpt", "hf-llama")


@dataclass(frozen=True)
class Case:
    model: str
    devices: int
    label: str
    pins: dict

    @property
    def name(self) -> str:
        return f"{self.model}/{self.label}"


CASES: list[Case] = ([Case(m, 2, label, pins) for m in MODELS for label, pins in PINS_2.items()]
                     + [Case(m, 4, label, pins) for m in MODELS_4 for label, pins in PINS_4.items()])


def _plan_file(outdir: str, case: Case) -> Path:
    return Path(outdir, "plans", case.name.replace("/", "__") + ".json")


def compile_case(case: Case, outdir: str) -> None:
    """Plan ``case`` as ``partita compile`` would; write the plan, or the planner's refusal."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec

    factory, spec, _ = MODELS[case.model]
    path = _plan_file(outdir, case)
    try:
        plan = compile_model(factory, Options(inputs=[parse_input_spec(spec)],
                                              cluster=load_cluster("local", devices=case.devices),
                                              optimizer="sgd-momentum", world_size=case.devices, **case.pins)).plan
    except PartitaError as e:  # a user error: the pins cannot hold for this model
        path.write_text(json.dumps({"refused": f"{type(e).__name__}: {e}"}))
        return
    plan.save(path.with_suffix(".plan.json"))
    path.write_text(json.dumps({"plan": str(path.with_suffix(".plan.json"))}))


@torch.no_grad()
def _eval_loss(reference: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> float:
    """The reference's loss in eval mode, averaged over the plan's micro-batches (its recipe)."""
    reference.eval()
    losses = [default_loss(reference(x[i:i + micro_batch]), y[i:i + micro_batch]).item()
              for i in range(0, x.shape[0], micro_batch)]
    reference.train()
    return sum(losses) / len(losses)


def run_case(ctx: DistContext, case: Case, outdir: str) -> dict:
    """One training step of the case's plan beside one process; a plan that fails to run raises,
    naming the case."""
    entry = json.loads(_plan_file(outdir, case).read_text())
    if "refused" in entry:
        return {"case": case.name, "refused": entry["refused"]}
    plan = load_plan(entry["plan"], world_size=ctx.world_size)
    factory, _, batch = MODELS[case.model]
    torch.manual_seed(100)
    reference = factory()
    x, y = batch(plan.training.global_batch)
    try:
        model = ParallelModel(copy.deepcopy(reference), plan, Options(loss=default_loss, optimizer=OPTIMIZERS["sgd"]),
                              ctx=ctx)
        model.eval()  # evaluate as PyTorch's eval mode runs: dropout off, batch norm's running statistics
        evaluated = model.evaluate(x, targets=y)
        model.train()
        loss = model.train_step(x, targets=y)
        final = model.full_state_dict(buffers=False)
    except Exception as e:
        raise RuntimeError(f"{case.name} ({plan.mesh}, {plan.training.schedule}, ZeRO-{plan.training.zero_stage}): "
                           f"the plan failed to run: {e}") from e
    start = {n: p.detach().clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    ref_evaluated = _eval_loss(reference, x, y, plan.training.micro_batch_size)
    ref_loss = reference_step(reference, OPTIMIZERS["sgd"](reference.parameters()), default_loss, x, y,
                              micro_batch=plan.training.micro_batch_size)
    ref_final = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}  # tied names too
    del model
    gc.collect()
    return {"case": case.name, "mesh": str(plan.mesh), "micro_batch": plan.training.micro_batch_size,
            "micro_batches": plan.training.grad_accum_steps, "schedule": plan.training.schedule,
            "zero": plan.training.zero_stage, "recompute": [s.index for s in plan.stages if s.recompute != "none"],
            "split": sorted({d.strategy for d in plan.nodes} - {"replicate"}),
            "loss": loss, "ref_loss": ref_loss, "evaluated": evaluated, "ref_evaluated": ref_evaluated,
            "params": gaps({k: v for k, v in final.items() if k in ref_final}, ref_final),
            "names_unlike_the_models": sorted(set(final) ^ set(ref_final)),
            # how far the step moved the reference's parameters
            "moved": max_abs_diff(ref_final, start)}


def compile_and_run_2(ctx: DistContext, outdir: str) -> list[dict]:
    """Every case planned (half on each rank), then the 2-device plans run on both ranks."""
    Path(outdir, "plans").mkdir(exist_ok=True)
    for case in CASES[ctx.rank::ctx.world_size]:
        compile_case(case, outdir)
    dist.barrier()
    return [run_case(ctx, case, outdir) for case in CASES if case.devices == 2]


def run_4(ctx: DistContext, outdir: str) -> list[dict]:
    return [run_case(ctx, case, outdir) for case in CASES if case.devices == 4]


# launch name -> (world size, the checks each rank runs); "run4" reads the plans "compile+run2" wrote
LAUNCHES: dict[str, tuple[int, Callable[[DistContext, str], list[dict]]]] = {
    "compile+run2": (2, compile_and_run_2),
    "run4": (4, run_4),
}
