"""The long fuzz run's figures (helpers.fuzz): inputs tried, clean errors,
runs and uncaught exceptions per input kind, printed at the end of a run
that sets CCT_FUZZ_EXAMPLES (workers of pytest -n keep their own tallies:
run it with -p no:xdist)."""
import os
import tempfile

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
