"""Where the repository's files are, from wherever a test file sits."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
