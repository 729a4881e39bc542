"""Recomputation's modes (core/recompute.py): which nodes an attention core holds, what selective
recomputation saves and costs against hand-worked figures, and the planner choosing it on its own
where memory binds. (The runtime's selective recomputation against one process:
test_runtime_recompute.py.)"""

from __future__ import annotations

import functools
import math

import pytest

from examples.models import GPT, MLP, GPTConfig, hf_llama
from partita.core.cluster import PRESETS
from partita.core.errors import PartitaError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.options import Options
from partita.core.pins import Pins, TrainingRequest
from partita.core.recompute import FULL, NONE, SELECTIVE
from partita.passes.pipeline.costs import node_costs, recompute_costs
from partita.passes.profile import profile_model
from partita.passes.search import plan_search

B, S, H, A = 1, 16, 64, 4  # batch, sequence, width, heads of the small GPT


@functools.cache
def _profile(factory, spec: str):
    captured = capture(factory, [parse_input_spec(spec)], loss=default_loss)
    return profile_model(captured), [math.prod(shape) for shape, _ in captured.params.values()]


def _gpt(flash: bool, layers: int = 2, width: int = H, heads: int = A, seq: int = S):
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, flash=flash)
    return _profile(lambda: GPT(cfg), f"idx=int64[{B},{seq}]")


def _cores(profile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for _, a in profile.graph.nodes(data=True):
        if a.get("attention_core"):
            out.setdefault(a["attention_core"], []).append(a["op"].split(".")[1])
    return out


def test_an_attention_core_runs_from_the_scores_to_the_product_with_v():
    manual, _ = _gpt(flash=False)
    cores = _cores(manual)
    assert sorted(cores) == ["transformer.h.0/attention0", "transformer.h.1/attention0"]
    ops = cores["transformer.h.0/attention0"]
    assert ops[0] == ops[-1] == "matmul" and "softmax" in ops and "masked_fill" in ops
    assert "linear" not in ops  # the projections stay outside: they keep their activations
    fused, _ = _gpt(flash=True)
    assert _cores(fused) == {f"transformer.h.{i}/attention0":
                                                         ["scaled_dot_product_attention"] for i in (0, 1)}
    llama, _ = _profile(lambda: hf_llama(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=128, vocab_size=256, attn_implementation="eager"),
                        "input_ids=int64[1,16]")
    ops = _cores(llama)["model.model.layers.1/attention0"]
    assert ops[0] == ops[-1] == "matmul" and "softmax" in ops and "dropout" in ops and "linear" not in ops
    mlp, _ = _profile(MLP, "x=float32[4,64]")
    assert not _cores(mlp)


def test_selective_recomputation_drops_the_scores_and_reruns_the_core():
    """Hand-worked, fp32, per layer (Korthikanti et al. 2022, section 4.1's terms without dropout):
    the core saves Q and K for Q K^T (2 s b h x 4 bytes), the softmax's output (a s^2 b x 4), the
    causal mask (s^2 bools) and V for the product (s b h x 4). Recomputed, it keeps its inputs Q, K
    and V (3 s b h x 4) and drops 4 a s^2 b + s^2 = 4352 bytes; its backward runs its forward again."""
    profile, _ = _gpt(flash=False)
    c = node_costs(profile, PRESETS["dgx-a100"], TrainingRequest(global_batch=B), B)
    rc = recompute_costs(c)
    assert [r.mode for r in rc.options] == [SELECTIVE, FULL] and not rc.forced
    selective = rc.options[0]
    at = [i for i, core in enumerate(c.cores) if core == "transformer.h.0/attention0"]
    core_saved = sum(c.saved_bytes[i] for i in at)
    assert core_saved == 3 * S * B * H * 4 + 4 * A * S * S * B + S * S
    assert c.core_inputs[at[0]] == 3 * S * B * H * 4 and not any(c.core_inputs[i] for i in at[1:])
    assert sum(selective.costs.saved_bytes) == sum(c.saved_bytes) - 2 * (4 * A * S * S * B + S * S)
    assert selective.transient_bytes == core_saved  # one core's activations, rebuilt in its backward
    added = [selective.costs.backward_s[i] - c.backward_s[i] for i in range(len(c.order))]
    assert added == pytest.approx([c.forward_s[i] if c.cores[i] else 0.0 for i in range(len(c.order))])
    # full recomputation keeps less and reruns more
    full = rc.options[1]
    assert sum(full.costs.saved_bytes) < sum(selective.costs.saved_bytes)
    assert sum(full.costs.backward_s) > sum(selective.costs.backward_s)
    assert recompute_costs(c, pin=NONE) is None
    assert [r.mode for r in recompute_costs(c, pin=SELECTIVE).options] == [SELECTIVE]


def test_the_planner_chooses_selective_recomputation_where_memory_binds():
    """A 4-layer GPT at sequence 4096 with its attention written out, on one 80 GB A100: 12 samples a
    micro-batch hold 63 GB of activations, 5 a s / h = 320 of Korthikanti's 34 + 5 a s / h per token
    in the (T, T) scores. Without recomputation it does not fit; the planner recomputes the attention
    cores, not whole layers (slower), and nothing at 8 samples, where the plain plan fits."""
    model = _gpt(flash=False, layers=4, width=1024, heads=16, seq=4096)
    cluster = PRESETS["dgx-a100"].with_devices(1)
    request = TrainingRequest(global_batch=48, precision="bf16-mixed")
    chosen = plan_search(*model, cluster, request, Pins(micro_batch_size=12))
    assert [s.recompute for s in chosen.stages] == [SELECTIVE] and chosen.memory.fits
    with pytest.raises(PartitaError, match="does not fit|needs"):
        plan_search(*model, cluster, request, Pins(micro_batch_size=12, recompute=NONE))
    full = plan_search(*model, cluster, request, Pins(micro_batch_size=12, recompute=FULL))
    assert full.step_s > chosen.step_s and full.memory.total < chosen.memory.total
    plain = plan_search(*model, cluster, request, Pins(micro_batch_size=8))
    assert [s.recompute for s in plain.stages] in ([], [NONE]) and plain.step_s < chosen.step_s


def test_the_recompute_option_names_a_mode():
    assert Options(recompute=True).recompute == FULL and Options(recompute=False).recompute == NONE
    assert Options(recompute="selective").pins().recompute == SELECTIVE
    assert Pins(recompute=True).recompute == FULL and Pins(recompute="full").recomputes
    assert not Pins(recompute="none").recomputes
    with pytest.raises(PartitaError, match="not one of none, selective, full"):
        Options(recompute="attention")
    with pytest.raises(PartitaError, match="--recompute selective with --zero 3"):
        Pins(recompute="selective", zero_stage=3)
    mlp = _profile(MLP, "x=float32[4,64]")
    with pytest.raises(PartitaError, match="no attention core") as e:
        plan_search(*mlp, PRESETS["dgx-a100"].with_devices(1), TrainingRequest(global_batch=4),
                    Pins(recompute=SELECTIVE))
    assert "--recompute full" in e.value.hint
