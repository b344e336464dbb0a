"""`disagg demo` end to end: real processes, a workload, a JSON summary, a plot."""

import json
import subprocess
import sys

import pytest

from harness.processes import running

pytestmark = pytest.mark.slow


def test_demo_json_summary_and_plot(tmp_path):
    png = tmp_path / "bench.png"
    with running([sys.executable, "-m", "disagg", "demo", "--requests", "10", "--concurrency", "3",
                  "--prompt-len", "16:600", "--json", "--no-progress", "--plot", str(png)],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as demo:   # (its workers too)
        stdout, stderr = demo.communicate(timeout=240)
    assert demo.returncode == 0, stdout[-2000:] + stderr[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["requests"] == summary["verified"] == 10 and summary["failed"] == 0
    assert summary["gb_per_s"] > 0 and summary["bytes"] > 0
    for phase in ("total", "transfer", "control", "verify"):
        assert {"p50", "p90", "p99"} <= set(summary["latency_ms"][phase])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
