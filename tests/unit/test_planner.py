"""The data-parallel planner: known answers from costs alone, hand-worked step times, refusals."""

import dataclasses

import pytest

from partita.core.cluster import GB, PRESETS, load_cluster
from partita.core.errors import InfeasibleError, PartitaError
from partita.core.pins import Pins, TrainingRequest
from partita.passes.cost_model import collective_time
from partita.passes.dp.buckets import gradient_buckets
from tests.oracles import choose_data_parallel


@dataclasses.dataclass(frozen=True)
class FakeProfile:
    """A profile with round numbers, so step times can be worked by hand."""

    num_params: int
    flops_per_sample: float  # forward + backward
    act_per_sample: int  # saved bytes per sample (fp32)
    batch_size: int = 1
    param_dtype: str = "torch.float32"

    @property
    def flops_fwd(self) -> float:
        return self.flops_per_sample / 3 * self.batch_size

    @property
    def flops_bwd(self) -> float:
        return self.flops_per_sample * 2 / 3 * self.batch_size

    def activation_bytes(self, micro_batch: int) -> int:
        return self.act_per_sample * micro_batch


def test_gradient_buckets_reverse_greedy():
    mb = 1024 * 1024
    # params of 10, 20, 5 MB (fp32 elements): reversed 5, 20 -> 25 closes; then 10.
    numels = [10 * mb // 4, 20 * mb // 4, 5 * mb // 4]
    assert gradient_buckets(numels, 4, 25 * mb) == [25 * mb, 10 * mb]
    assert gradient_buckets([100], 4, 25 * mb) == [400]


def test_pure_dp_over_all_devices_when_compute_dominates():
    # 1B params, 6 GFLOP... per sample: a compute-heavy model on one DGX A100 node.
    prof = FakeProfile(num_params=int(1e9), flops_per_sample=6 * 1e9 * 2048, act_per_sample=int(2e9))
    cluster = PRESETS["dgx-a100"]
    req = TrainingRequest(global_batch=64, precision="bf16-mixed")
    d = choose_data_parallel(prof, [int(1e9)], cluster, req)
    assert d.best.dp == 8
    # bf16 activations are half the captured fp32 bytes: 1 GB/sample; 16 GB state; 72 GB usable.
    assert d.best.memory.activations == 1e9 * d.best.micro_batch_size
    assert d.best.memory.fits


def test_hand_worked_step_time():
    prof = FakeProfile(num_params=int(1e9), flops_per_sample=1e12, act_per_sample=int(1e8))
    cluster = PRESETS["dgx-a100"]
    req = TrainingRequest(global_batch=16, precision="bf16-mixed")
    d = choose_data_parallel(prof, [int(1e9)], cluster, req, Pins(dp=8, micro_batch_size=2))
    c = d.best
    assert (c.dp, c.micro_batch_size, c.grad_accum_steps) == (8, 2, 1)
    compute = 2 * 1e12 / (312e12 * 0.7)
    assert c.cost.compute_s == pytest.approx(compute)
    # bf16 grads: 2 GB held in 25 MiB buckets, each sent in the reduce dtype, fp32 (4 GB on the wire),
    # a ring all-reduce over NVLink (300 GB/s, 5 us) and one call, which costs the preset's launch of
    # an op (40 us)
    link = cluster.link_for_group(8)
    buckets = gradient_buckets([int(1e9)], 2)
    ar = sum(collective_time("all_reduce", 2 * b, 8, link) for b in buckets)
    assert c.cost.comm_s["dp_all_reduce"] == pytest.approx(ar)
    assert ar == pytest.approx((40e-6 + 2 * 7 * 5e-6) * len(buckets) + 2 * 4e9 * 7 / 8 / 300e9)
    # optimizer: read+write 16 GB of state at 2 TB/s
    assert c.cost.optimizer_s == pytest.approx(2 * 16e9 / 2.0e12)
    assert c.step_s == pytest.approx(compute + ar + 2 * 16e9 / 2e12)


def test_memory_forces_gradient_accumulation():
    # 100M params fp32 Adam = 1.6 GB state; 1 GB activations per sample; 8 GB device.
    prof = FakeProfile(num_params=int(1e8), flops_per_sample=1e12, act_per_sample=int(1e9))
    cluster = dataclasses.replace(PRESETS["dgx-a100"], memory_bytes=int(8 * GB), memory_reserve=0.0)
    req = TrainingRequest(global_batch=64, precision="fp32")
    d = choose_data_parallel(prof, [int(1e8)], cluster, req)
    assert d.best.dp == 8
    # 8 samples per rank; 1.6 GB + mb GB <= 8 GB -> micro-batch at most 6 and dividing 8: 4.
    assert d.best.micro_batch_size == 4 and d.best.grad_accum_steps == 2
    too_big = [c for c in d.candidates if c.dp == 8 and c.micro_batch_size == 8]
    assert too_big and not too_big[0].fits
    assert "does not fit" in d.reasons[(8, 8)]


def test_fewer_replicas_when_the_network_is_the_bottleneck():
    # A 1B-param model with little compute per sample on two 10 GbE nodes:
    # all-reducing 4 GB of fp32 gradients across nodes costs more than it saves.
    prof = FakeProfile(num_params=int(1e9), flops_per_sample=1e11, act_per_sample=int(1e6))
    cluster = load_cluster("ethernet-10g", nodes=2)
    req = TrainingRequest(global_batch=16, precision="bf16-mixed")
    d = choose_data_parallel(prof, [int(1e9)], cluster, req)
    assert d.best.dp <= 8  # stays inside a node (PCIe), never across the 10 GbE link
    cross = [c for c in d.candidates if c.dp == 16]
    assert cross and "slower" in d.reasons[(16, cross[0].micro_batch_size)]
    assert "gradient all-reduce" in d.reasons[(16, cross[0].micro_batch_size)]


def test_infeasible_names_the_numbers_and_what_to_relax():
    prof = FakeProfile(num_params=int(7e9), flops_per_sample=1e12, act_per_sample=int(1e8))
    req = TrainingRequest(global_batch=8, precision="bf16-mixed")
    with pytest.raises(InfeasibleError) as e:
        choose_data_parallel(prof, [int(7e9)], PRESETS["dgx-a100"], req)
    msg = str(e.value)
    assert "dp=8 with micro-batch 1" in msg
    assert "112.0 GB per device" in msg and "budget 72.0 GB" in msg
    # the hint prices the fix: ZeRO-3 over 8 ranks holds 112 / 8 = 14 GB of state
    assert "ZeRO-1 38.5 GB (fits)" in msg and "ZeRO-3 14.1 GB (fits)" in msg


def test_batch_that_does_not_divide_is_refused():
    prof = FakeProfile(num_params=1000, flops_per_sample=1e6, act_per_sample=100)
    req = TrainingRequest(global_batch=10)
    with pytest.raises(PartitaError, match="global batch 10 does not divide over dp=4"):
        choose_data_parallel(prof, [1000], PRESETS["local"], req, Pins(world_size=4))
    with pytest.raises(PartitaError, match="does not divide"):
        choose_data_parallel(prof, [1000], PRESETS["local"], req, Pins(dp=3))


def test_unsupported_pins_are_refused():
    with pytest.raises(PartitaError, match="pipelines are chosen by"):  # a pp pin is the pipeline planner's
        choose_data_parallel(FakeProfile(1000, 1e9, 100), [1000], PRESETS["local"], TrainingRequest(global_batch=8),
                             Pins(pp=2))
    with pytest.raises(PartitaError, match="tensor parallelism arrives"):  # a tp pin is the mesh search's
        choose_data_parallel(FakeProfile(1000, 1e9, 100), [1000], PRESETS["local"], TrainingRequest(global_batch=8),
                             Pins(tp=2))
    assert Pins(zero_stage=3).zero_stage == 3  # a ZeRO pin is the joint search's (tests/unit/test_search.py)
    with pytest.raises(PartitaError, match="--zero 4 must be 0, 1, 2 or 3"):
        Pins(zero_stage=4)
    with pytest.raises(PartitaError, match="positive"):
        Pins(dp=0)
