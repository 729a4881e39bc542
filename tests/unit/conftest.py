"""The unit tier: captures kept for reuse in each process."""


def pytest_configure(config):
    """One capture per model structure, inputs and loss in this process (core/capture_memo.py): the
    tests build the same few models hundreds of times. Not in tests/integration's ranks: there a
    tensor-parallel check measured other saved bytes with it on (tests/integration/test_runtime_tp.py,
    sequence parallelism saving 8.5% against 15%), not yet explained, so the runs use fresh captures."""
    from partita.core.capture_memo import memoize_captures

    memoize_captures()
