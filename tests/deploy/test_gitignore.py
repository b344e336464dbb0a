"""The key files the README has a user write (`disagg keygen FILE`) are ignored by git, so a
`git add -A` after the tour cannot commit a deployment's secret."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_key_file_the_readme_writes_is_ignored():
    files = set(re.findall(r"disagg keygen ([^\s`'\"]+)", (ROOT / "README.md").read_text()))
    assert "deployment.key" in files, files
    for name in files:
        run = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", name], timeout=30)
        assert run.returncode == 0, f"{name} is not in .gitignore"
