"""Each rank loads only its share (``ParallelModel.loader``, runtime/data.py: the runs on several
processes (tests/unit/test_per_rank_data.py has the single-process checks)."""

from __future__ import annotations

import torch

from tests.harness import fast_cluster, launch
from tests.workers import per_rank_data_worker as worker


def test_per_rank_loading_matches_the_global_batch_bit_for_bit_and_reads_one_dp_th(tmp_path):
    ranks = launch(2, worker.run, fast_cluster(tmp_path), timeout_s=300)
    for rank, results in enumerate(ranks):
        assert [r["mesh"] for r in results] == list(worker.MESHES)
        for r in results:
            what = f"rank {rank} {r['mesh']}"
            g, mine = r["global"], r["local"]
            assert len(g["losses"]) == worker.STEPS and g["losses"] == mine["losses"], (what, g["losses"],
                                                                                         mine["losses"])
            assert g["state"].keys() == mine["state"].keys(), what
            differ = [n for n in g["state"] if not torch.equal(torch.tensor(g["state"][n]),
                                                                torch.tensor(mine["state"][n]))]
            assert not differ, (what, "parameters differ", differ)
            assert r["dp"] == (2 if r["mesh"] in ("dp2", "zero3") else 1), what
            everything = worker.STEPS * worker.BATCH
            assert g["read"] == list(range(everything)), what  # the global mode: every sample on every rank
            assert mine["bytes"] * r["dp"] == g["bytes"], (what, mine["bytes"], g["bytes"])
            if r["mesh"] == "pp2":  # per field: stage 0 fetches only the inputs, stage 1 only the targets
                f = r["fields"]
                assert f["losses"] == g["losses"], (what, f["losses"], g["losses"])
                assert all(torch.equal(torch.tensor(g["state"][n]), torch.tensor(f["state"][n])) for n in g["state"])
                assert f["reads"] == [["idx"], ["targets"]][rank], (what, f["reads"])
                half = g["bytes"] // 2  # x and y: the same number of int64 tokens each
                assert f["bytes"] == [[half, 0], [0, half]][rank], (what, f["bytes"], g["bytes"])
            if r["mesh"] == "tp2":
                assert any(pl.startswith("shard") for pl in r["sharded"]), (what, "nothing sharded", r["sharded"])
    for i, mesh in enumerate(worker.MESHES):
        reads = [ranks[rank][i]["local"]["read"] for rank in range(2)]
        if ranks[0][i]["dp"] == 2:  # two replicas: disjoint halves of the samples
            assert sorted(reads[0] + reads[1]) == list(range(worker.STEPS * worker.BATCH)), mesh
        else:  # one replica (tp, pp ranks): the same share
            assert reads[0] == reads[1], mesh
