"""The linter and the formatter CI runs, on the whole tree (rules in pyproject.toml's
[tool.ruff]; the pre-commit hooks run the same checks before a commit)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, str(ROOT)], capture_output=True, text=True, cwd=ROOT)


def test_ruff_finds_nothing():
    proc = _ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_tree_is_formatted():
    """`ruff format` leaves every file as it is (run it before committing: the hook does)."""
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
