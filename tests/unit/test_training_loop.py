"""The training loop's parts users bring, in one process (issue 32): an LR scheduler stepped by
``train_step`` and carried through a checkpoint exactly, each step's metrics written to
TensorBoard under ``log_dir``, and ``partita run`` sharing a node's cores out as
OMP_NUM_THREADS."""

from __future__ import annotations

import sys

import pytest
import torch

from examples.models import GPT, GPTConfig
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.errors import PartitaError
from partita.core.model.inputs import parse_input_spec
from partita.core.options import RUN, Options, option_fields
from partita.runtime.engine import ParallelModel
from partita.runtime.processes.launch import omp_threads
from partita.runtime.state.marker import CheckpointError

LR = 3e-3


def gpt() -> GPT:
    torch.manual_seed(2)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))


@pytest.fixture(scope="module")
def plan():
    """A one-process plan of a 2-layer GPT."""
    return compile_model(gpt(), Options(inputs=[parse_input_spec("idx=int64[4,8]")],
                                        cluster=load_cluster("local", devices=1), world_size=1)).plan


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def halving(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def model(plan, **options) -> ParallelModel:
    return ParallelModel(gpt(), plan, Options(optimizer=adamw, log_every=0, **options))


def batches(n: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 9), generator=g) for _ in range(n)]


def train(m: ParallelModel, seqs: list[torch.Tensor]) -> list:
    return [m.train_step(seq[:, :-1], targets=seq[:, 1:]) for seq in seqs]


@pytest.mark.parametrize("scheduler, words", [
    (torch.optim.lr_scheduler.StepLR, "scheduler= got the class StepLR, not a factory of the optimizer"),
    (lambda opt: torch.optim.lr_scheduler.StepLR(opt), "scheduler= failed on the run's optimizer"),
    (lambda opt: None, "scheduler= returned None, not a scheduler"),
    (lambda opt: torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 1),
     "a scheduler over another optimizer: this run's learning rate would never change"),
])
def test_a_scheduler_that_would_not_schedule_this_run_is_one_message(plan, scheduler, words):
    """Each was a traceback (a class given for a factory, a factory that fails) or silent (None; a
    scheduler over another optimizer left the model's learning rate untouched)."""
    with pytest.raises(PartitaError) as e:
        model(plan, scheduler=scheduler)
    assert words in e.value.message and e.value.hint, e.value.message


def test_a_scheduler_steps_after_each_optimizer_step_as_plain_torch_does(plan):
    m = model(plan, scheduler=halving)
    results = train(m, batches(4))
    opt = adamw([torch.nn.Parameter(torch.zeros(1))])
    sched, expected = halving(opt), []
    for _ in range(4):
        expected.append(opt.param_groups[0]["lr"])  # the lr this step's update uses
        opt.step()
        sched.step()
    assert [r.lr for r in results] == expected == [LR, LR / 2, LR / 4, LR / 8]
    assert isinstance(m.scheduler, torch.optim.lr_scheduler.StepLR)
    assert m.scheduler.get_last_lr() == sched.get_last_lr() == [LR / 16]
    assert m.optimizer.param_groups[0]["lr"] == LR / 16
    plain = model(plan)
    assert plain.scheduler is None and [r.lr for r in train(plain, batches(2))] == [LR, LR]


def test_a_step_left_out_for_a_nonfinite_loss_leaves_the_schedule_where_it_was(plan):
    m = model(plan, scheduler=halving, nonfinite="skip")
    seq = batches(1)[0]
    train(m, [seq])
    ignored = torch.full_like(seq[:, 1:], -100)  # every target ignored: the mean loss is 0/0
    assert torch.isnan(torch.tensor(float(m.train_step(seq[:, :-1], targets=ignored))))
    assert m.nonfinite_skipped == 1 and m.scheduler.last_epoch == 1
    assert train(m, [seq])[0].lr == LR / 2


def test_a_scheduler_survives_a_checkpoint_and_resume_exactly(plan, tmp_path):
    seqs = batches(4)
    whole = model(plan, scheduler=halving)
    lrs_whole = [r.lr for r in train(whole, seqs)]

    first = model(plan, scheduler=halving)
    lrs = [r.lr for r in train(first, seqs[:2])]
    first.save_checkpoint(tmp_path / "c")
    resumed = model(plan, scheduler=halving)
    assert resumed.scheduler.last_epoch == 0
    resumed.load_checkpoint(tmp_path / "c")
    assert resumed.step == 2 and resumed.scheduler.state_dict() == first.scheduler.state_dict()
    lrs += [r.lr for r in train(resumed, seqs[2:])]

    assert lrs == lrs_whole == [LR, LR / 2, LR / 4, LR / 8]
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()
    got, want = dict(resumed.module.named_parameters()), dict(whole.module.named_parameters())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoints_schedule_is_not_dropped_silently(plan, tmp_path):
    m = model(plan, scheduler=halving)
    train(m, batches(1))
    m.save_checkpoint(tmp_path / "c")
    with pytest.raises(CheckpointError) as e:
        model(plan).load_checkpoint(tmp_path / "c")
    assert "saved with a StepLR LR scheduler, and this run has none" in e.value.message
    other = model(plan, scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9))
    with pytest.raises(CheckpointError, match="this run's is ExponentialLR"):
        other.load_checkpoint(tmp_path / "c")
    other.load_checkpoint(tmp_path / "c", optimizer="state")  # asked: this run's schedule kept
    assert other.step == 1 and other.scheduler.last_epoch == 0


def test_each_steps_metrics_are_written_to_tensorboard_and_read_back(plan, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = model(plan, scheduler=halving, log_dir=str(tmp_path / "tb"))
    results = train(m, batches(3))
    m.metrics_log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= tags and "peak_memory_bytes" not in tags  # CPU

    def logged(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # TensorBoard keeps float32 scalars
    assert logged("loss") == [(i, f32(r)) for i, r in enumerate(results)]  # indices from 0, as a loop counts
    assert logged("lr") == [(0, f32(LR)), (1, f32(LR / 2)), (2, f32(LR / 4))]
    assert logged("grad_norm") == [(i, f32(r.grad_norm)) for i, r in enumerate(results)]
    assert logged("tokens_per_s") == [(i, f32(r.tokens_per_s)) for i, r in enumerate(results)]
    pred = plan.predicted
    assert logged("mfu") == [(i, f32(pred.mfu * pred.step_time_s / r.seconds)) for i, r in enumerate(results)]


def test_log_dir_without_tensorboard_is_one_error_naming_the_install(plan, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(PartitaError) as e:
        model(plan, log_dir=str(tmp_path / "tb"))
    assert "pip install tensorboard" in e.value.hint
    assert not (tmp_path / "tb").exists()


def test_the_options_are_checked_and_reach_the_ranks(monkeypatch, tmp_path):
    with pytest.raises(PartitaError, match="scheduler='cosine' is not a factory of the optimizer"):
        Options(scheduler="cosine")
    with pytest.raises(PartitaError, match="no use in a forward-only plan"):
        Options(inference=True, scheduler=halving)
    assert "--log-dir" in [f.metadata["flag"] or "--log-dir" for f in option_fields(RUN, command="run")
                           if f.name == "log_dir"]
    assert "scheduler" not in [f.name for f in option_fields(command="run")]  # a function: the API's only
    monkeypatch.setenv("PARTITA_LOG_DIR", str(tmp_path))
    assert Options().with_environment().log_dir == str(tmp_path)


def test_the_launcher_shares_the_cores_out_unless_omp_num_threads_is_set():
    env: dict[str, str] = {}
    line = omp_threads(env, nproc_per_node=2, cpu_count=16)
    assert env == {"OMP_NUM_THREADS": "8"}
    assert line.startswith("partita: OMP_NUM_THREADS=8 for each of 2 rank(s)") and "override" in line
    env = {}
    omp_threads(env, nproc_per_node=4, cpu_count=2)
    assert env == {"OMP_NUM_THREADS": "1"}  # never 0
    env = {"OMP_NUM_THREADS": "3"}
    assert omp_threads(env, nproc_per_node=2, cpu_count=16) is None and env == {"OMP_NUM_THREADS": "3"}


class _FakeWandb:
    """What partita calls of ``wandb`` (wandb.init, run.log(data, step=), run.finish), recorded."""

    def __init__(self) -> None:
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished += 1


def test_each_steps_metrics_go_to_wandb_when_asked_for(plan, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    m = model(plan, scheduler=halving, wandb_project="partita-tests")
    results = train(m, batches(2))
    m.metrics_log.close()
    (init,) = fake.inits
    assert init["project"] == "partita-tests" and init["dir"] is None  # no log_dir: wandb's own
    assert init["config"]["dp"] == plan.mesh.dp and init["config"]["predicted_mfu"] == plan.predicted.mfu
    assert [s for s, _ in fake.logged] == [0, 1] and fake.finished == 1
    for (_, got), r, lr in zip(fake.logged, results, (LR, LR / 2)):
        assert got["loss"] == float(r) and got["grad_norm"] == r.grad_norm and got["lr"] == lr
        assert got["tokens_per_s"] == r.tokens_per_s and "peak_memory_bytes" not in got  # CPU


def test_wandb_without_the_package_is_one_error_naming_the_install(plan, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(PartitaError) as e:
        model(plan, wandb_project="p")
    assert "pip install wandb" in e.value.hint
    monkeypatch.setenv("PARTITA_WANDB_PROJECT", "q")
    assert Options().with_environment().wandb_project == "q"
