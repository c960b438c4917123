"""The long fuzz run's figures (helpers.fuzz): inputs tried, clean errors,
runs and uncaught exceptions per input kind, printed at the end of a run
that sets CCT_FUZZ_EXAMPLES (workers of pytest -n keep their own tallies:
run it with -p no:xdist)."""
import os
import tempfile

import pytest

from helpers import fuzz


def pytest_terminal_summary(terminalreporter):
    if os.environ.get(fuzz.EXAMPLES_ENV) and fuzz.TALLY:
        terminalreporter.section("fuzz: inputs per kind")
        for line in fuzz.report():
            terminalreporter.write_line(line)


def pytest_configure(config):
    # hypothesis keeps caches in ./.hypothesis: keep them out of the working tree
    from hypothesis.configuration import set_hypothesis_home_dir
    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="cct-hypothesis-"))


@pytest.fixture(autouse=True)
def some_inputs_run():
    """Each fuzz test's inputs must not all end in errors: some must run, or
    the test would pass while checking nothing (as it did when a memory limit
    left no room for any net). numba and LLVM are loaded first: a solver's
    memory plan measures what loading them takes, which the headroom would
    not hold."""
    from cct.runtime.memory_plan import runtime_bytes
    runtime_bytes()
    before = {kind: tally["ran"] for kind, tally in fuzz.TALLY.items()}
    tried = {kind: tally["tried"] for kind, tally in fuzz.TALLY.items()}
    yield
    for kind, tally in fuzz.TALLY.items():
        if tally["tried"] - tried.get(kind, 0) >= 50:
            assert tally["ran"] > before.get(kind, 0), f"{kind}: none of the inputs ran"
