"""`disagg bench --plot`: the PNG, its title, and throughput as a rate per time bin."""

import argparse
import datetime

import numpy as np
import pytest
from PIL import Image

from disagg.tools import bench
from disagg.tools.bench import PHASES, run_workload
from disagg.tools.plot import plot, plot_title, throughput_bins

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload(**extra) -> argparse.Namespace:
    return argparse.Namespace(seed=3, prompt_len="64:2048", requests=40, concurrency=4, max_new_tokens=8,
                              no_progress=True, plot=None, **extra)


def synthetic(n: int, failed_every: int = 7) -> tuple[list[dict], list[float]]:
    rng = np.random.default_rng(0)
    results = []
    for i in range(n):
        if i % failed_every == 0:
            results.append({"ok": False, "reason": "decode failed: TransferError: reset"})
            continue
        timings = {phase: float(rng.uniform(0.05, 30)) for phase in PHASES}
        results.append({"ok": True, "verified": True, "bytes": 4_000_000, "mode": "direct", "transport": "mooncake",
                        "timings_ms": timings})
    return results, sorted(rng.uniform(0, 2.0, n).tolist())


def test_the_title_names_preset_page_size_concurrency_transport_and_date():
    results, _ = synthetic(10)
    title = plot_title(workload(preset="tiny-hybrid", page_size=16, transport="auto"), results,
                       datetime.datetime(2025, 3, 4, 5, 6))
    first, second = title.splitlines()
    for part in ("preset tiny-hybrid", "page size 16", "concurrency 4", "transport mooncake", "2025-03-04 05:06"):
        assert part in first
    assert "10 requests" in second and "prompt 64:2048 tokens" in second and "8 new tokens" in second


def test_a_bench_run_names_what_it_cannot_know():
    """`disagg bench` only sees the router: no preset, page size or transport unless a request told."""
    title = plot_title(workload(), [{"ok": False, "reason": "busy"}], datetime.datetime(2025, 1, 1))
    assert "preset unknown" in title and "transport unknown" in title and "concurrency 4" in title


def test_plot_writes_a_png_titled_with_the_run(tmp_path):
    results, finished = synthetic(40)
    title = plot_title(workload(preset="tiny-swa", page_size=None), results, datetime.datetime(2025, 6, 7, 8, 9))
    path = tmp_path / "bench.png"
    plot(results, finished, 2.0, str(path), title)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as png:
        assert png.text["Title"] == title.replace("\n", "; ")
        assert png.size[0] > 800


def test_plot_of_a_run_where_everything_failed(tmp_path):
    results = [{"ok": False, "reason": "busy"}] * 5
    path = tmp_path / "failed.png"
    plot(results, [0.01 * i for i in range(5)], 0.05, str(path), plot_title(workload(), results))
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_throughput_is_a_rate_per_bin_not_a_running_average():
    """Four requests of 1 GB done in the first bin of a 10 s run, none after: the later bins
    read 0 (a cumulative average would still show traffic there)."""
    results = [{"ok": True, "bytes": 1e9}] * 4 + [{"ok": False}]
    bins = throughput_bins(results, [0.1, 0.2, 0.3, 0.4, 9.99], 10.0)
    width = bins["width_s"]
    assert width == pytest.approx(0.5) and len(bins["gb_per_s"]) == 20
    assert bins["gb_per_s"][0] == pytest.approx(4 / width) and not bins["gb_per_s"][1:].any()
    assert bins["ok_per_s"][0] == pytest.approx(4 / width) and not bins["ok_per_s"][1:].any()
    assert bins["failed_per_s"][-1] == pytest.approx(1 / width) and bins["failed_per_s"][:-1].sum() == 0
    assert bins["edges_s"][-1] >= 10.0


def test_a_run_with_plot_writes_it_and_says_where_on_stderr(tmp_path, monkeypatch, capsys):
    results, _ = synthetic(12)
    answers = iter(results)
    monkeypatch.setattr(bench, "post_json", lambda url, body, timeout: next(answers))
    path = tmp_path / "run.png"
    args = workload(preset="tiny-hybrid", page_size=8)
    args.requests, args.plot = 12, str(path)
    summary = run_workload("http://router", args)
    captured = capsys.readouterr()
    assert f"plot written to {path}" in captured.err and captured.out == ""   # --json keeps stdout whole
    assert path.read_bytes()[:8] == PNG_MAGIC and summary["requests"] == 12
