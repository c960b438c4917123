"""ruff over the whole tree and mypy over the modules with type hints, as
pyproject.toml configures them: an unused or undefined name, a syntax error
or a type error fails the suite."""
import subprocess
import sys

from helpers.paths import REPO
from helpers.requirements import require


def test_ruff_finds_nothing():
    require("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing():
    require("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
