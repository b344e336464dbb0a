"""`disagg demo` end to end: real processes, a workload, a JSON summary, a plot."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_json_summary_and_plot(tmp_path):
    png = tmp_path / "bench.png"
    out = subprocess.run([sys.executable, "-m", "disagg", "demo", "--requests", "10", "--concurrency", "3",
                          "--prompt-len", "16:600", "--json", "--no-progress", "--plot", str(png)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["requests"] == summary["verified"] == 10 and summary["failed"] == 0
    assert summary["gb_per_s"] > 0 and summary["bytes"] > 0
    for phase in ("total", "transfer", "control", "verify"):
        assert {"p50", "p90", "p99"} <= set(summary["latency_ms"][phase])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
