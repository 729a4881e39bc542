"""partita's tests, a package: test modules and the rank processes import the shared helpers by
their names here (``tests.harness``, ``tests.workers.dp_worker``, ``tests.workers.tied_script``), with the
repository's root on the path (pyproject's ``pythonpath``; ``PYTHONPATH`` for the scripts a test
starts as files, tests/harness.py's ``ENV``)."""
