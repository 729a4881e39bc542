"""Optimizer offload (core/optimizers.py OFFLOAD): the runtime against one process on 2 gloo ranks
(offload_worker.py measures, this file asserts), the cost model's figures worked by hand, and the
planner offloading on its own where nothing else fits. bf16-mixed with offload runs in
test_mixed_precision.py (mp_worker's dp2-offload cases)."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from examples.models import GPT, GPTConfig
from partita.core.cluster import GB, PRESETS
from partita.core.errors import PartitaError
from partita.core.model.capture import capture
from partita.core.model.inputs import parse_input_spec
from partita.core.model.losses import default_loss
from partita.core.pins import Pins, TrainingRequest
from partita.passes.cost_model import offload_step_time, offloaded_state, state_bytes_per_param
from partita.passes.profile import profile_model
from partita.passes.search import plan_search

RTOL, ATOL = 1e-4, 2e-5  # fp32: the plan sums the same numbers as one process, in another order


def test_offloaded_state_and_step_time_by_hand():
    """bf16-mixed AdamW: the device keeps 2 + 2 bytes a parameter, the host 12 (fp32 master, m, v).
    One step of 1e9 parameters on a DGX A100: 4 GB over PCIe at 25 GB/s (0.16 s) and the host's pass
    over 2 x 12 + 2 bytes a parameter at 51.2 GB/s (0.508 s). fp32 keeps its parameters on the device
    and a copy on the host as the masters: 4 + 8 there."""
    a100 = PRESETS["dgx-a100"]
    mixed = state_bytes_per_param("bf16-mixed", "adamw")
    device, host = offloaded_state(mixed, "optimizer", "bf16-mixed")
    assert (device.params, device.grads, device.optimizer, host) == (2, 2, 0, 12)
    assert offload_step_time(1e9, mixed, host, a100) == pytest.approx(4 / 25 + 26 / 51.2)
    device, host = offloaded_state(state_bytes_per_param("fp32", "adamw"), "optimizer", "fp32")
    assert (device.params, device.grads, device.optimizer, host) == (4, 4, 0, 12)
    assert offloaded_state(mixed, "none", "bf16-mixed") == (mixed, 0.0)
    assert offload_step_time(1e9, mixed, 12, dataclasses.replace(a100, host_bandwidth=0.0)) == math.inf


@functools.cache
def _gpt(layers: int):
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=layers, n_head=32, n_embd=4096)
    captured = capture(lambda: GPT(cfg), [parse_input_spec("idx=int64[1,1024]")], loss=default_loss)
    return profile_model(captured), [math.prod(shape) for shape, _ in captured.params.values()]


def test_the_planner_offloads_where_nothing_else_fits():
    """5.2B parameters on one 80 GB A100 in bf16-mixed: 16 bytes a parameter are 84 GB, past the
    72 GB budget with any micro-batch and recomputation; with the state and masters on the host the
    device holds 4 bytes a parameter. A 2B model fits without, and is not offloaded (the host's step
    costs 1.3 s a step)."""
    one = PRESETS["dgx-a100"].with_devices(1)
    request = TrainingRequest(global_batch=8, precision="bf16-mixed")
    big = plan_search(*_gpt(24), one, request)
    assert big.offload == "optimizer" and big.memory.fits and big.memory.optimizer == 0
    assert big.memory.host == pytest.approx(12 * _gpt(24)[0].num_params, rel=1e-6)
    with pytest.raises(PartitaError, match="needs 9[0-9.]+ GB"):
        plan_search(*_gpt(24), one, request, Pins(offload="none"))
    small = plan_search(*_gpt(8), one, request)
    pinned = plan_search(*_gpt(8), one, request, Pins(offload="optimizer"))
    assert small.offload == "none" and pinned.offload == "optimizer"
    assert pinned.step_s - small.step_s == pytest.approx(pinned.optimizer_s - small.optimizer_s, rel=0.05)
    assert pinned.memory.total < small.memory.total - 20 * GB
    with pytest.raises(PartitaError, match="gives no host bandwidth"):
        plan_search(*_gpt(8), dataclasses.replace(one, host_bandwidth=0.0), request, Pins(offload="optimizer"))
