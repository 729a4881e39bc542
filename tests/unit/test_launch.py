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
