"""What every test shares: captures kept for reuse, the in-process CLI, plans several files read."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """One capture per model, inputs and loss in this process (core/model/capture_memo.py): the tests build
    the same few models hundreds of times; the ranks of tests/harness.py keep theirs too."""
    from partita.core.model.capture_memo import memoize_captures

    memoize_captures()


@pytest.fixture
def cli(capsys):
    """Run the CLI in this process as the console script does: ``cli(*args)`` returns
    (exit code, stdout, stderr)."""
    from partita.compiler.cli import main

    def run(*args):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="session")
def tp2_plan_path(tmp_path_factory) -> Path:
    """The example GPT planned for tp=2 on 2 local processes (one forward all-reduce per row-split
    linear: the plan a hand edit must not break silently)."""
    from partita.compiler.cli import main

    path = tmp_path_factory.mktemp("tp2") / "gpt.tp2.plan.json"
    try:
        main(["compile", f"{ROOT}/examples/models.py:gpt_tiny", "--input", "idx=int64[16,64]", "--devices", "2",
              "--tp", "2", "-o", str(path)])
    except SystemExit as e:
        assert not e.code, f"compiling the tp2 plan failed ({e.code})"
    return path


@pytest.fixture(scope="session")
def dp2_plan(tmp_path_factory) -> Path:
    """tests/workers/tied_script.py's tied GPT planned for dp=2 on 2 local processes, saved: the plan the
    launcher tests run under `partita run`."""
    from partita.compiler.compile import compile_model
    from partita.core.cluster import load_cluster
    from partita.core.model.inputs import parse_input_spec
    from partita.core.options import Options
    from tests.workers import tied_script as script

    plan = compile_model(script.build("tied-gpt"),
                         Options(inputs=[parse_input_spec(f"idx=int64[4,{script.SEQ}]")],
                                 cluster=load_cluster("local", devices=2), world_size=2, dp=2)).plan
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")
