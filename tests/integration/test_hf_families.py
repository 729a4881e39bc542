"""Unmodified Hugging Face models (issue: any model as users write it): their ModelOutput is taken
as it comes (the loss attaches to `logits`, or loss="model" uses the model's own from labels=),
planned by the planner on dp2, tp2, pp2 and ZeRO-3 and run on 2 gloo processes: the same losses and
parameters as one process. Tolerance 1e-4 relative: fp32, only the reduction order differs."""

import json
from pathlib import Path

import pytest
import torch

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import resolve_loss
from partita.core.options import Options
from tests.harness import fast_cluster, launch
from tests.workers import families_script as script

MESHES = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "zero3": dict(dp=2, zero=3)}
def test_bare_hf_models_train_on_every_axis_as_one_process(tmp_path):
    cluster = load_cluster(fast_cluster(tmp_path), devices=2)  # fast links: TP really splits
    spec = parse_input_spec(f"input_ids=int64[{script.BATCH},{script.SEQ}]")
    runs = []
    for name, (_, loss, _, _) in script.MODELS.items():
        for mesh, pins in MESHES.items():
            plan = compile_model(script.build(name), Options(inputs=[spec], cluster=cluster, world_size=2, **pins,
                                                             loss=resolve_loss(loss))).plan
            runs.append(f"{name}={plan.save(tmp_path / f'{name}-{mesh}.json')}")
    launch(2, script.run, str(tmp_path), runs, timeout_s=600)
    for name in script.MODELS:
        reference = script.reference(name)
        for mesh in MESHES:
            _same_as_one_process(tmp_path / f"{name}-{mesh}.json", tmp_path / f"{name}-{mesh}.pt", reference,
                                 f"{name} {mesh}")
def test_more_families_vit_t5_a_masked_llama_gemma_and_phi_train_as_one_process(tmp_path):
    """ViT (pixel_values), T5 (three inputs) and Llama with an attention_mask of padded rows, planned
    by the planner (two axes each, all four between them), Gemma on tp=2 and Phi on pp=2, and run
    through the decorator on 2 processes: the same losses and parameters as one process (fp32;
    1e-4 relative: only the reduction order differs)."""
    from tests.workers import families_more_worker as more

    cluster = load_cluster(fast_cluster(tmp_path), devices=2)
    runs = []
    for name, (_, specs, _, meshes) in more.MODELS.items():
        for mesh in meshes:
            plan = compile_model(more.build(name), Options(inputs=[parse_input_spec(s) for s in specs],
                                                           cluster=cluster, world_size=2, **MESHES[mesh])).plan
            assert plan.mesh.dp * plan.mesh.tp * plan.mesh.pp == 2
            runs.append(f"{name}={plan.save(tmp_path / f'more-{name}-{mesh}.json')}")
    launch(2, more.run, str(tmp_path), runs)
    for name, (_, _, _, meshes) in more.MODELS.items():
        reference = more.reference(name)
        for mesh in meshes:
            _same_as_one_process(tmp_path / f"more-{name}-{mesh}.out.json", tmp_path / f"more-{name}-{mesh}.out.pt",
                                 reference, f"{name} {mesh}")


def _same_as_one_process(losses: Path, state: Path, reference: tuple[list[float], dict], what: str) -> None:
    """A run's losses (JSON) and full state (torch.save) equal one process's (fp32; 1e-4 relative:
    only the reduction order differs); every name in the run's state is one of the reference's."""
    ref_losses, ref_state = reference
    got = json.loads(losses.read_text())["losses"]
    assert got == pytest.approx(ref_losses, rel=1e-4, abs=1e-5), (what, got, ref_losses)
    held = torch.load(state, weights_only=True)
    assert set(held) <= set(ref_state), (what, sorted(set(held) - set(ref_state))[:5])
    for k, v in held.items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{what} {k}: {m}")
