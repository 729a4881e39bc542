"""A rank SIGKILLed mid-run: `partita run --max-restarts 1 --checkpoint-dir D --checkpoint-every 2`
restarts every rank, they resume from the newest complete checkpoint by themselves, and the run
ends with the losses and parameters of an uninterrupted run, bit for bit (dp=2 and pp=2 plans)."""



from partita.runtime.state.marker import COMPLETE
from partita.runtime.state.periodic import latest, step_dir


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        d = step_dir(tmp_path, step)
        d.mkdir()
        if complete:
            (d / COMPLETE).write_text("{}")
    assert latest(tmp_path) == step_dir(tmp_path, 4)  # step 6 was being written when the kill landed
    assert latest(tmp_path / "none") is None
