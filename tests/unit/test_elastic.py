"""`partita run --nnodes 1:2`: two launchers on this host, one rank each, train a dp2 plan; node 1's
launcher is SIGKILLed after step 3 (its rank dies with it). The survivor names the lost node,
restarts, waits --rejoin-wait for it, plans again for its one process and resumes from the newest
checkpoint (step 2), resharded into the new plan: from there its losses and final parameters are
those of a fresh one-process resume from that checkpoint into that plan, bit for bit."""


import torch

from tests.workers import tied_script as script


def batch(step: int, size: int) -> torch.Tensor:  # as tests/workers/restart_script.py draws it
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, script.VOCAB, (size, script.SEQ + 1), generator=g)


class _Handler:
    """A rendezvous handler whose count of nodes waiting to join the test sets."""

    waiting = 0

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return "run"


def test_a_node_asking_to_join_is_let_in_at_the_next_complete_checkpoint(tmp_path, capsys):
    from partita.runtime.processes.agent import JoinAtCheckpoint
    from partita.runtime.state.marker import COMPLETE
    from partita.runtime.state.periodic import step_dir

    def complete(step):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / COMPLETE).write_text("{}")

    inner = _Handler()
    handler = JoinAtCheckpoint(inner, tmp_path)
    complete(2)
    assert handler.num_nodes_waiting() == 0 and handler.get_run_id() == "run"
    inner.waiting = 1
    assert [handler.num_nodes_waiting() for _ in range(3)] == [0, 0, 0]  # training goes on meanwhile
    assert "1 node(s) asking to join; they join at the next checkpoint" in capsys.readouterr().err
    step_dir(tmp_path, 4).mkdir()  # being written: not yet
    assert handler.num_nodes_waiting() == 0
    (step_dir(tmp_path, 4) / COMPLETE).write_text("{}")
    assert handler.num_nodes_waiting() == 1  # the agent restarts every rank at the new size
