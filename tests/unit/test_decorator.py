"""The decorator path end to end: the same user script in one process, under torchrun, and under
`partita run`, against a plain single-process loop; the collectives each rank ran equal the plan's.
The planner's ZeRO and recomputing plans run the same script on the harness's long-lived group
with the plan handed over as `partita run` hands it (``compile_and_launch``): the launcher itself
is covered by the plan-file, TP and pipeline tests, and four fresh processes per plan cost ~15 s."""


import pytest
import torch

import partita
from examples.models import GPT, GPTConfig, gpt_tiny
from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.errors import PlanError
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from tests.harness import plain_training
from tests.workers import decorator_script as script


def reference():
    """A plain loop: whole batch, no partita."""
    torch.manual_seed(0)
    model = gpt_tiny()
    return plain_training(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5), script.batches())


@pytest.fixture(scope="module")
def ref():
    return reference()


def test_outside_torchrun_the_decorated_model_trains_in_one_process(ref):
    model = script.make_model()
    assert model.ctx.world_size == 1 and model.plan.mesh.dp == 1
    logits = model(next(script.batches())[0])  # behaves as the plain model
    assert logits.shape == (script.BATCH, script.SEQ, 256)
    losses = [model.train_step(x, targets=y) for x, y in script.batches()]
    assert losses == pytest.approx(ref[0], rel=1e-5, abs=1e-6)


def test_a_plan_for_another_model_or_world_size_is_refused(tmp_path):
    specs = [parse_input_spec("idx=int64[8,32]")]
    plan = compile_model(gpt_tiny, Options(inputs=specs, cluster=load_cluster("local", devices=1), world_size=1)).plan
    path = plan.save(tmp_path / "tiny.json")
    torch.manual_seed(0)
    other = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=4, n_embd=64))
    with pytest.raises(PlanError, match="this plan was made for another model"):
        partita.parallelize(other, plan=str(path))
    plan4 = compile_model(gpt_tiny, Options(inputs=specs, cluster=load_cluster("local", devices=4), world_size=4)).plan
    path4 = plan4.save(tmp_path / "tiny4.json")
    with pytest.raises(PlanError, match="this plan needs 4 processes"):
        partita.parallelize(gpt_tiny(), plan=str(path4))


def test_the_default_optimizer_is_fused_adamw_and_steps_as_torchs_default_does(monkeypatch):
    """One pass over the state (what the cost model prices), the same update as torch's foreach
    AdamW within float rounding (the fused kernel evaluates the same formula in another order),
    and the foreach step where torch has no fused kernel for the parameters."""
    from partita.core.optimizers import default_optimizer

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        for p in ps:
            p.grad = torch.randn_like(p)
        return ps

    fused, plain = params(), params()
    a, b = default_optimizer(fused), torch.optim.AdamW(plain, lr=1e-3)
    assert a.defaults["fused"] and not b.defaults.get("fused")
    for _ in range(3):
        a.step()
        b.step()
    for x, y in zip(fused, plain):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)

    real = torch.optim.AdamW

    def no_fused_kernel(ps, **kw):
        if kw.get("fused"):
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(ps, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused_kernel)
    assert not default_optimizer(params()).defaults.get("fused")
