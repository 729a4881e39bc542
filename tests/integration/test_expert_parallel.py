"""Expert parallelism (issue 31): what starts processes (gloo
ranks, launchers, the console script, a browser); tests/unit/test_expert_parallel.py has the one-process checks."""

from __future__ import annotations

from tests.harness import beyond, launch, numbers_beyond
from tests.unit.test_expert_parallel import LAYERS, TOLERANCE, _all_to_alls
from tests.workers import expert_worker as worker


def _check(results: list[list[dict]], cells: list[tuple]) -> None:
    for rank, per_rank in enumerate(results):
        for r, (dp, ep, precision, *rest) in zip(per_rank, cells):
            micro_batches, recompute, zero, pp = (list(rest) + [1, None, None, None])[:4]
            what = f"rank {rank} {r['case']}"
            assert "refused" not in r, (what, r.get("refused"))
            tol = TOLERANCE[precision]
            assert r["ep"] == ep, (what, r["mesh"])
            assert not numbers_beyond(r["losses"], r["ref_losses"], rtol=tol["loss"], atol=0), (
                what, r["losses"], r["ref_losses"])
            assert not beyond(r["params"], rtol=tol["rtol"], atol=tol["atol"]), what
            assert r["local_expert"][0] == worker.EXPERTS // ep, (what, "this rank's experts", r["local_expert"])
            assert r["full_expert"][0] == worker.EXPERTS, (what, "the experts gathered back", r["full_expert"])
            assert r["moe_layers"] == (LAYERS if pp is None else LAYERS // pp), (what, r["moe_layers"])
            if ep == 1:  # the experts whole on every rank (a loop-style layer's, captured as grouped matmuls)
                assert not r["calls"].get("all_to_all/ep") and not r["planned"].get("all_to_all/ep"), what
                assert all(layout.get("ep") is None for layout in r["layouts"].values()), (what, r["layouts"])
            else:
                _check_exchanges(r, what, dp, ep, micro_batches, recompute)
            # the parameters a rank holds (1/ep of the experts; its stage's) are what the plan predicts: a
            # pipeline stage's count is a rank's (the one stage of a plan without a pipeline counts the model)
            if zero != 3 and pp is not None:
                assert r["param_numel"] == r["stage_params"], (what, r["param_numel"], r["stage_params"])
            if zero != 3 and pp is None:
                assert r["param_bytes"] == r["predicted_params"], (what, r["param_bytes"], r["predicted_params"])


def _check_exchanges(r: dict, what: str, dp: int, ep: int, micro_batches: int, recompute: str | None) -> None:
    """The all-to-alls over "ep" and the all-reduce over "edp" a step ran, against the plan's."""
    rows_only = _all_to_alls(micro_batches, recompute, r["expert_layers"])
    if r["case"].startswith("gpt-oss"):  # and each per-row value carried with the rows, there and back
        assert r["calls"].get("all_to_all/ep", 0) > rows_only, (what, r["calls"])
    else:
        assert r["calls"].get("all_to_all/ep") == rows_only, (what, r["calls"])
    # the plan lists the all-to-alls the step ran; a rank's own rows sent are exactly as priced
    # (their dtype the compute dtype's); the rows sent back depend on the routing
    assert r["planned"]["all_to_all/ep"] == r["calls"]["all_to_all/ep"], (what, r["planned"], r["calls"])
    counts, rows = min(r["planned_sizes"]["all_to_all/ep"]), max(r["planned_sizes"]["all_to_all/ep"])
    assert {counts, rows} <= set(r["sizes"]["all_to_all/ep"]), (what, r["planned_sizes"], r["sizes"])
    # the expert gradients' all-reduce over the ranks holding the same experts: none where each rank's
    # experts are its own alone (dp = ep: a group of one makes no call)
    assert bool(r["calls"].get("all_reduce/edp")) == bool(r["planned"].get("all_reduce/edp")) == (dp // ep > 1), (
        what, r["calls"], r["planned"])
    assert all(layout.get("ep") == "shard(0)" for layout in r["layouts"].values()), (what, r["layouts"])


def test_experts_split_over_two_ranks_train_as_one_process():
    cells = [(2, 2, "fp32"), (2, 2, "bf16-mixed")]
    _check(launch(2, worker.run, cells), cells)


def test_gpt_oss_experts_carry_their_per_row_bias_and_train_as_one_process():
    """GPT-OSS adds to each grouped matmul's rows a bias gathered by expert id, on the rank's own rows;
    under ep=2 that value travels with the rows (core/experts.py ``carried``): it crashed before (122 rows
    against 128). fp32 with ZeRO-1, bf16-mixed with ZeRO-3 and 2 micro-batches, against one process."""
    cells = [(2, 2, "fp32", 1, None, 1, None, "gpt-oss"), (2, 2, "bf16-mixed", 2, None, 3, None, "gpt-oss")]
    _check(launch(2, worker.run, cells), cells)


def test_dbrx_loop_experts_are_captured_and_train_at_ep_1_and_2_as_one_process():
    """DBRX runs its experts in a loop over those a batch hits (``nonzero``): not capturable before. The
    capture writes the loop as grouped matmuls over its (E x F, H) weights (core/model/moe_loops.py); at
    ep=1 (dp2: the eager loop runs) and at ep=2 with ZeRO-1 and ZeRO-3 it trains as one process."""
    cells = [(2, 1, "fp32", 1, None, None, None, "dbrx"), (2, 2, "bf16-mixed", 2, None, 1, None, "dbrx")]
    _check(launch(2, worker.run, cells), cells)
def test_jetmoe_feed_forward_and_attention_experts_train_at_ep_1_and_2_as_one_process():
    """JetMoE routes its feed-forward and its attention experts by a gate that lists the rows per expert
    in Python (``tolist``): not capturable before. The capture writes each as grouped matmuls
    (core/model/moe_loops.py); the attention experts' query and output projections are two expert layers,
    attention running between them on each token's own rank. At ep=1 (dp2, fp32) and at ep=2 with ZeRO-1
    and 2 micro-batches (bf16-mixed) it trains as one process."""
    cells = [(2, 1, "fp32", 1, None, None, None, "jetmoe"), (2, 2, "bf16-mixed", 2, None, 1, None, "jetmoe")]
    _check(launch(2, worker.run, cells), cells)
def test_experts_split_over_four_ranks_with_micro_batches_recomputation_and_zero_train_as_one_process():
    cells = [(4, 2, "fp32"), (4, 4, "bf16-mixed"), (4, 2, "fp32", 2, "full"), (4, 2, "bf16-mixed", 2, None),
             (4, 2, "fp32", 1, None, 1), (4, 2, "bf16-mixed", 1, None, 3)]
    _check(launch(4, worker.run, cells), cells)
def test_experts_split_inside_pipeline_stages_train_as_one_process():
    """pp=2 x dp=2, each stage's two dp ranks one expert group: a stage's all-to-alls are its own layer's."""
    cells = [(2, 2, "fp32", 2, None, None, 2), (2, 2, "bf16-mixed", 4, None, 1, 2)]
    _check(launch(4, worker.run, cells), cells)
def test_checkpoints_of_split_experts_resume_exactly_and_reshard_between_ep_degrees(tmp_path):
    cells = [(4, 2, 2), (4, 2, 4), (4, 4, 1)]
    for rank, results in enumerate(launch(4, worker.checkpoints, str(tmp_path), cells)):
        for r in results:
            what = f"rank {rank} {r['case']}"
            assert not beyond(r["state"], rtol=0, atol=0), f"{what}: the state loaded is the state saved"
            assert r["losses"] == r["going_on"], (what, r["losses"], r["going_on"])
