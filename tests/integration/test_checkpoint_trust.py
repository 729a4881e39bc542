"""Checkpoints that can be trusted, in one process (runtime/state/): the runs on several processes
(tests/unit/test_checkpoint_trust.py has the single-process checks)."""

from __future__ import annotations

from pathlib import Path

from partita.compiler.compile import compile_model
from partita.core.cluster import load_cluster
from partita.core.model.inputs import parse_input_spec
from partita.core.options import Options
from partita.runtime.state import periodic
from partita.runtime.state.marker import CheckpointError
from tests.unit.test_checkpoint_trust import gpt, trained


def failed_saves(tmp: str) -> dict:
    """In a child process: files may grow to 4 KB there (as on a full disk, a write past it fails).
    The limit is per process, and in pytest's it would stop pytest's own output to a log file."""
    import resource
    import signal

    plans = {2: compile_model(gpt(2), Options(inputs=[parse_input_spec("idx=int64[4,8]")],
                                              cluster=load_cluster("local", devices=1), world_size=1)).plan}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    m = trained(plans, steps=1, checkpoint_dir=str(Path(tmp) / "ckpt"), checkpoint_every=1)
    out: dict = {}
    try:
        m.wait_for_checkpoint()  # the periodic save in the background: its failure comes here
    except CheckpointError as e:
        out["periodic"] = e.message
    try:
        m.save_checkpoint(Path(tmp) / "by-hand")
    except CheckpointError as e:
        out["by_hand"] = e.message
    out["counted"] = periodic.latest(Path(tmp) / "ckpt") is not None
    return out


def test_a_failed_save_is_one_error_naming_the_file(tmp_path):
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = pool.submit(failed_saves, str(tmp_path)).result(timeout=300)
    assert out["periodic"] == (f"cannot write checkpoint {tmp_path / 'ckpt' / 'step-00000001'}: "
                               f"{tmp_path / 'ckpt' / 'step-00000001' / '__0_0.distcp'}: File too large")
    assert "__0_0.distcp: File too large" in out["by_hand"], out
    assert not out["counted"]  # no marker: it never counts
