"""scripts/ as a person runs them: the examples in a script's --help run as written (small
enough for a CPU), test.sh --help says what it does without setting anything up, and a
second setup.sh with nothing changed installs nothing."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def help_example(script: str, comment: str) -> list[str]:
    """The command line under the `# COMMENT...` lines of `script --help` (continued lines
    joined), with this venv's python standing for `.venv/bin/python`."""
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    i = next(i for i, line in enumerate(out) if line.strip().startswith("# " + comment))
    while out[i].strip().startswith("#"):   # the comment may go on for a line or two
        i += 1
    command = ""
    while True:
        line = out[i].strip()
        command += line.removesuffix("\\") + " "
        if not line.endswith("\\"):
            break
        i += 1
    words = shlex.split(command)
    assert words[0] == ".venv/bin/python", words   # as setup.sh leaves it
    return [sys.executable, *words[1:]]


@pytest.mark.slow
def test_bench_stream_cpu_example_runs_as_written():
    """Issue 36: the CPU example in scripts/bench_stream.py --help (gpt-oss-120b geometry at
    32k tokens, a 65536-token pool per side) missed its 30 s deadline and left the pool full."""
    command = help_example("scripts/bench_stream.py", "CPU")
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "KV ready after compute" in out.stdout and "FAILED" not in out.stdout, out.stdout
