"""How many clusters this session's `start_cluster` started (tests/e2e/conftest.py counts, its
terminal summary reports). A module of its own because pytest loads conftest.py as ``conftest``
while the test modules import it as ``tests.e2e.conftest``: two module objects, two counters."""

started = 0
