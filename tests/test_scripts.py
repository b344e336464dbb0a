"""scripts/ as a person runs them: the examples in a script's --help run as written (small
enough for a CPU), test.sh --help says what it does without setting anything up, and a
second setup.sh with nothing changed installs nothing."""

import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def help_example(script: str, comment: str) -> list[str]:
    """The command line under the `# COMMENT...` lines of `script --help` (continued lines
    joined), with this venv's python standing for `.venv/bin/python`."""
    out = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    i = next(i for i, line in enumerate(out) if line.strip().startswith("# " + comment))
    while out[i].strip().startswith("#"):  # the comment may go on for a line or two
        i += 1
    command = ""
    while True:
        line = out[i].strip()
        command += line.removesuffix("\\") + " "
        if not line.endswith("\\"):
            break
        i += 1
    words = shlex.split(command)
    assert words[0] == ".venv/bin/python", words  # as setup.sh leaves it
    return [sys.executable, *words[1:]]


@pytest.mark.slow
def test_bench_stream_cpu_example_runs_as_written():
    """Issue 36: the CPU example in scripts/bench_stream.py --help (gpt-oss-120b geometry at
    32k tokens, a 65536-token pool per side) missed its 30 s deadline and left the pool full."""
    command = help_example("scripts/bench_stream.py", "CPU")
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "KV ready after compute" in out.stdout and "FAILED" not in out.stdout, out.stdout


def test_test_sh_help_says_what_it_does_without_setting_up(tmp_path):
    """Issue 36: `scripts/test.sh --help` ran the whole set-up, then printed pytest's help.
    (Were it to set up here, it would try to create the venv named below, with a python that
    cannot.)"""
    env = {"PATH": "/usr/bin:/bin", "VENV": str(tmp_path / "venv"), "PYTHON": "false"}
    for flag in ("--help", "-h"):
        out = subprocess.run(["scripts/test.sh", flag], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0 and out.stderr == "", (flag, out.stdout[-1000:], out.stderr[-1000:])
        assert out.stdout.startswith("usage: scripts/test.sh [PYTEST ARGS...]")
        assert "scripts/setup.sh" in out.stdout and "-- --help" in out.stdout  # what it does; pytest's help
    assert not (tmp_path / "venv").exists()


def _run_setup(venv: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(
        ["scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=280, env={**env, "VENV": str(venv)}
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out


@pytest.mark.slow
def test_a_second_setup_with_nothing_changed_does_not_run_pip(tmp_path):
    """Issue 36: setup.sh ran `pip install -e` every time (16-37 s for a no-op). A venv of its
    own (the heavy packages reached through a .pth to this venv's, so nothing large is
    installed): the first run installs disagg, the second finds it in place and runs no pip,
    and a stamp from another pyproject.toml installs again."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "shared-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    first = _run_setup(venv)
    assert "installing disagg[" in first.stderr, first.stderr
    second = _run_setup(venv)
    assert "installing" not in second.stderr and "pip not run" in second.stderr, second.stderr
    stamp = venv / ".disagg-setup-stamp"
    stamp.write_text(stamp.read_text().replace("pyproject.toml ", "pyproject.toml 0", 1))  # as if it changed
    third = _run_setup(venv)
    assert "installing disagg[" in third.stderr, third.stderr


@pytest.mark.slow
@pytest.mark.parametrize("senders", ["process", "thread"])
def test_bench_tp_runs_each_prefill_rank_where_asked_and_verifies_every_row(senders):
    """Issue 40: bench_tp ran all prefill ranks in one process (one GIL for every send), which
    no deployment does; --senders process (the CPU default) runs each rank's sender in a
    process of its own, each with its own chunk channel to every decode rank it feeds."""
    out = subprocess.run(
        [
            sys.executable,
            "scripts/bench_tp.py",
            "--preset",
            "tiny-swa",
            "--tp",
            "1:1,2:1,1:2",
            "--page-sizes",
            "4",
            "--tokens",
            "300",
            "--repeats",
            "1",
            "--json",
            "--senders",
            senders,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads(out.stdout)["rows"]
    assert [r["tp"] for r in rows] == ["1:1", "2:1", "1:2"]
    assert all(r["verified"] and r["sender_processes"] == (senders == "process") for r in rows)
    assert rows[1]["senders"] == 2 and rows[2]["senders"] == 2 and rows[2]["x_1to1"] is not None
    # the same sends prepared ahead (a worker's path; the bench checks each report says so and
    # verifies pages it overwrote with garbage first)
    assert all(r["ahead_ms"] > 0 and r["x_1to1_ahead"] is not None for r in rows)
    assert all(r["ahead_sender_ms_median"]["transfer_ms"] > 0 for r in rows)
    # what a repeat cost the host, every process of the row together (/proc's clock ticks: a row
    # this small may read 0)
    assert all(r["host_cpu_ms"] is not None and r["host_cpu_ms"] >= 0 for r in rows)
    for r in rows:  # split by role; thread senders are this process's own
        split = r["host_cpu_ms_by_role"]
        assert set(split) == {"senders", "decode", "bench"} and abs(sum(split.values()) - r["host_cpu_ms"]) < 0.5
        assert senders == "process" or split["senders"] == 0
