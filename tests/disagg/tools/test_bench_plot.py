"""`disagg bench --plot`: the PNG, its title, and throughput as a rate per time bin."""

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

import numpy as np
import matplotlib.colors
import matplotlib.figure
import pytest
from PIL import Image

from disagg.tools import bench
from disagg.tools.bench import PHASES, Run, run_workload, run_workloads
from disagg.tools.launcher import Launcher
from disagg.tools.plot import plot, plot_title, throughput_bins

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload(**extra) -> argparse.Namespace:
    return argparse.Namespace(
        seed=3, prompt_len="64:2048", requests=40, concurrency=4, max_new_tokens=8, no_progress=True, plot=None, **extra
    )


def synthetic(n: int, failed_every: int = 7) -> tuple[list[dict], list[float]]:
    rng = np.random.default_rng(0)
    results = []
    for i in range(n):
        if i % failed_every == 0:
            results.append({"ok": False, "reason": "decode failed: TransferError: reset"})
            continue
        timings = {phase: float(rng.uniform(0.05, 30)) for phase in PHASES}
        results.append(
            {
                "ok": True,
                "verified": True,
                "bytes": 4_000_000,
                "mode": "direct",
                "transport": "mooncake",
                "timings_ms": timings,
            }
        )
    return results, sorted(rng.uniform(0, 2.0, n).tolist())


def test_the_title_names_preset_page_size_concurrency_transport_and_date():
    results, _ = synthetic(10)
    title = plot_title(
        workload(preset="tiny-hybrid", page_size=16, transport="auto"),
        [Run("", results, [], 1.0)],
        datetime.datetime(2025, 3, 4, 5, 6),
    )
    first, second = title.splitlines()
    for part in ("preset tiny-hybrid", "page size 16", "concurrency 4", "transport mooncake", "2025-03-04 05:06"):
        assert part in first
    assert "10 requests" in second and "prompt 64:2048 tokens" in second and "8 new tokens" in second


def test_a_bench_run_names_what_it_cannot_know():
    """`disagg bench` only sees the router: no preset, page size or transport unless a request told."""
    title = plot_title(
        workload(), [Run("", [{"ok": False, "reason": "busy"}], [0.1], 1.0)], datetime.datetime(2025, 1, 1)
    )
    assert "preset unknown" in title and "transport unknown" in title and "concurrency 4" in title


def test_plot_writes_a_png_titled_with_the_run(tmp_path):
    results, finished = synthetic(40)
    runs = [Run("", results, finished, 2.0)]
    title = plot_title(workload(preset="tiny-swa", page_size=None), runs, datetime.datetime(2025, 6, 7, 8, 9))
    path = tmp_path / "bench.png"
    plot(runs, str(path), title)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as png:
        assert png.text["Title"] == title.replace("\n", "; ")
        assert png.size[0] > 800


def test_plot_of_a_run_where_everything_failed(tmp_path):
    results = [{"ok": False, "reason": "busy"}] * 5
    path = tmp_path / "failed.png"
    runs = [Run("", results, [0.01 * i for i in range(5)], 0.05)]
    plot(runs, str(path), plot_title(workload(), runs))
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
    assert f"plot written to {path}" in captured.err and captured.out == ""  # --json keeps stdout whole
    assert path.read_bytes()[:8] == PNG_MAGIC and summary["requests"] == 12


@pytest.fixture(name="saved")
def saved_figures(monkeypatch) -> list:
    """Each figure a plot saves (the PNG is still written), to read its panels."""
    figures = []
    real = matplotlib.figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def _latency_panels(fig) -> list:
    return [ax for ax in fig.axes if ax.get_title().startswith("latency per phase")]


def test_every_phase_has_a_colour_of_its_own(tmp_path, monkeypatch, saved):
    """Issue 36: 12 phases on matplotlib's 10-colour cycle drew total, rebuild and check alike."""
    results, _ = synthetic(12, failed_every=100)
    answers = iter(results)
    monkeypatch.setattr(bench, "post_json", lambda url, body, timeout: next(answers))
    args = workload()
    args.requests, args.plot = 12, str(tmp_path / "run.png")
    run_workload("http://router", args)
    (panel,) = _latency_panels(saved[-1])
    colours = {line.get_label(): matplotlib.colors.to_hex(line.get_color()) for line in panel.get_lines()}
    assert set(colours) == set(PHASES)
    assert len(set(colours.values())) == len(PHASES), colours


def test_stream_layers_both_plots_both_runs_in_one_png(tmp_path, monkeypatch, saved):
    """Issue 36: with --stream-layers both each run wrote the PNG, so only the last was left."""
    results, _ = synthetic(20, failed_every=100)
    answers = iter(results)
    monkeypatch.setattr(bench, "post_json", lambda url, body, timeout: next(answers))
    path = tmp_path / "both.png"
    args = workload(stream_layers="both", preset="tiny-hybrid")
    args.requests, args.plot = 10, str(path)
    summaries = run_workloads("http://router", args)
    assert set(summaries) == {"stream_off", "stream_on"}
    panels = _latency_panels(saved[-1])
    assert [ax.get_title() for ax in panels] == [
        "latency per phase (CDF): stream off",
        "latency per phase (CDF): stream on",
    ]
    assert all(len(ax.get_lines()) == len(PHASES) for ax in panels)
    colours = [[line.get_color() for line in ax.get_lines()] for ax in panels]
    assert colours[0] == colours[1]  # a phase looks the same in both runs
    with Image.open(path) as png:
        assert "runs: stream off, then stream on" in png.text["Title"]


@pytest.mark.slow
def test_a_bench_against_a_router_started_by_hand_names_the_preset(tmp_path):
    """Issue 36: after the tour (workers and router started by hand) the plot said "preset
    unknown". The bench reads it from the workers' /health, found through the router's /ready."""
    png = tmp_path / "tour.png"
    pool = ["--preset", "tiny-full", "--max-tokens", "4096", "--max-requests", "8", "--host", "127.0.0.1"]
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *pool, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *pool, "--bootstrap-addr", prefill["bootstrap"])
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        bench_run = subprocess.run(
            [
                str(Path(sys.executable).with_name("disagg")),
                "bench",
                "--router",
                router["http"],
                "--requests",
                "2",
                "--prompt-len",
                "16",
                "--no-progress",
                "--json",
                "--plot",
                str(png),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert bench_run.returncode == 0, bench_run.stdout[-2000:] + bench_run.stderr[-2000:]
    with Image.open(png) as image:
        title = image.text["Title"]
    assert "preset tiny-full" in title and "preset unknown" not in title, title


def test_a_multiturn_plot_is_titled_with_its_conversations_not_the_random_prompts():
    args = workload(workload="multiturn", conversations=3, turns=4, system_prompt_len=2048, user_len="128")
    runs = [Run(label, synthetic(6)[0], [], 1.0) for label in ("reuse_on", "reuse_off")]
    second = plot_title(args, runs).splitlines()[1]
    assert second.startswith(
        "3 conversations x 4 turns, a system prompt of 2048 tokens, user messages of 128, 8 new tokens each, seed 3"
    ), second
    assert "64:2048" not in second and second.endswith("runs: reuse on, then reuse off")
