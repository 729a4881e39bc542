"""`partita run`: user errors on the ranks end as one message and exit 2 (not a traceback per rank
and torchrun's summary); the plan given to `partita run` and the script's plan= must agree; a
multi-node plan is not started on one host unless asked; SLURM's variables fill in the nodes."""



from partita.runtime.processes.launch import slurm_layout


def test_slurm_variables_give_the_nodes_and_the_rendezvous():
    env = {"SLURM_JOB_ID": "42", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[003-005,009],cpu1"}
    lay = slurm_layout(env)
    assert (lay.nnodes, lay.node_rank, lay.rdzv_endpoint, lay.run_id) == (4, 2, "gpu003:29500", "slurm-42")
    assert slurm_layout({"SLURM_JOB_ID": "1", "SLURM_NNODES": "1", "SLURM_NODELIST": "n7"}).rdzv_endpoint == "n7:29500"
    assert slurm_layout({}) is None


def _launched(monkeypatch, plan_path, tmp_path, **flags) -> dict:
    """What `partita run`'s checks hand the launcher (``launch`` replaced by a recorder)."""
    from partita.compiler import run
    from partita.core.options import Options
    from partita.runtime.processes import launch

    seen: dict = {}
    monkeypatch.setattr(launch, "launch", lambda nproc, argv, **kw: seen.update(nproc=nproc, **kw) or 0)
    script = tmp_path / "train.py"
    script.write_text("")
    defaults = dict(max_restarts=1, nnodes=None, rejoin_wait=None, node_rank=None, rdzv_endpoint=None,
                    standalone=False)
    options = Options(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    assert run.start(str(plan_path), str(script), (), lambda: options, **{**defaults, **flags}) == 0
    return seen


def test_an_elastic_run_on_one_host_needs_no_endpoint_and_keeps_the_plans_processes_per_node(
        dp2_plan, tmp_path, monkeypatch, capsys):
    from partita.compiler.run import local_port

    seen = _launched(monkeypatch, dp2_plan, tmp_path, nnodes=(1, 2))
    port = local_port(str(tmp_path / "ckpt"))
    assert seen["rdzv_endpoint"] == f"localhost:{port}" and seen["node_rank"] is None
    assert seen["nproc"] == 2 and seen["nnodes"] == "1:2"  # the plan's 2 processes on this node, not 2 // 2
    assert f"its nodes meet at localhost:{port}" in capsys.readouterr().err
    assert 20000 <= port < 30000 and local_port(str(tmp_path / "ckpt")) == port  # every launcher agrees
    # a fixed number of nodes shares the plan's ranks out over them, as before
    seen = _launched(monkeypatch, dp2_plan, tmp_path, nnodes=(2, 2), node_rank=0, rdzv_endpoint="h:1")
    assert seen["nproc"] == 1 and seen["nnodes"] == 2 and seen["rdzv_endpoint"] == "h:1"


def test_spanning_hosts_says_what_it_still_needs(dp2_plan, tmp_path, monkeypatch):
    import pytest

    from partita.core.errors import PartitaError

    with pytest.raises(PartitaError, match="need a rendezvous every node can reach") as e:
        _launched(monkeypatch, dp2_plan, tmp_path, nnodes=(1, 2), node_rank=1)
    assert "--rdzv-endpoint HOST:PORT" in e.value.hint
