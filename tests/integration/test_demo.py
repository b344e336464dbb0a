"""`disagg demo` end to end: real processes, a workload, a JSON summary, a plot; and the
table as a person reads it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import running

pytestmark = pytest.mark.slow

DISAGG = str(Path(sys.executable).with_name("disagg"))


def test_demo_json_summary_and_plot(tmp_path):
    png = tmp_path / "bench.png"
    with running(
        [
            DISAGG,
            "demo",
            "--requests",
            "10",
            "--concurrency",
            "3",
            "--prompt-len",
            "16:600",
            "--json",
            "--no-progress",
            "--plot",
            str(png),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as demo:  # (its workers too)
        stdout, stderr = demo.communicate(timeout=240)
    assert demo.returncode == 0, stdout[-2000:] + stderr[-2000:]
    summary = json.loads(stdout.strip())  # stdout is the JSON object and nothing else
    assert summary["requests"] == summary["verified"] == 10 and summary["failed"] == 0
    assert summary["gb_per_s"] > 0 and summary["bytes"] > 0
    for phase in ("total", "transfer", "control", "verify"):
        assert {"p50", "p90", "p99"} <= set(summary["latency_ms"][phase])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Issue 36: --json silenced the progress lines on stderr too; it changes stdout only.
    for said in ("starting prefill", "prefill ready in", "starting decode", "decode ready in", "router ready on"):
        assert said in stderr, (said, stderr[-2000:])


def test_demo_table_is_aligned_and_the_stand_in_check_says_tokens_only():
    """Issue 36: long phase names pushed their rows out of the columns, and the stand-in's
    summary claimed bit-identical logits it has none of."""
    with running(
        [DISAGG, "demo", "--requests", "4", "--prompt-len", "16:200", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as demo:
        stdout, stderr = demo.communicate(timeout=240)
    assert demo.returncode == 0, stdout[-2000:] + stderr[-2000:]
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("phase "))
    end = header.index("mean ms") + len("mean ms")
    rows = lines[lines.index(header) + 1 : lines.index("", lines.index(header))]
    assert "kv_ready_after_compute" in {row.split()[0] for row in rows}
    assert {len(row) for row in rows} == {end}, "\n".join([header, *rows])
    check = next(line for line in lines if line.startswith("token_match"))
    assert check.startswith("token_match 4/4") and "logits" not in check.replace("no logits", ""), check
