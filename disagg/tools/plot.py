"""`--plot PNG` of `disagg bench` and `disagg demo`: a latency CDF per phase and the
throughput per time bin, titled with what ran (matplotlib, imported only when asked for).
With `--stream-layers both` the PNG holds both runs, one row each, on one latency scale."""

import argparse
import datetime
import math

import numpy as np

from disagg.tools.runs import PHASES, Run

# One colour per phase, the same in every run's panel: matplotlib's default cycle has 10,
# fewer than the phases, so total, rebuild and check came out alike.
PHASE_COLOURS = dict(
    zip(
        PHASES,
        [
            "tab:blue",
            "tab:orange",
            "tab:green",
            "tab:red",
            "tab:purple",
            "tab:brown",
            "tab:pink",
            "tab:gray",
            "tab:olive",
            "tab:cyan",
            "black",
            "gold",
        ],
        strict=True,
    )
)


def plot_title(args: argparse.Namespace, runs: list[Run], when: datetime.datetime | None = None) -> str:
    """Two lines: what ran (preset, page size, concurrency, transport, date), then the workload
    (and the runs, where there are several)."""
    preset, page_size = getattr(args, "preset", None), getattr(args, "page_size", None)
    results = [r for run in runs for r in run.results]
    transports = sorted({r["transport"] for r in results if r.get("transport")})
    if not transports and getattr(args, "transport", "auto") not in (None, "auto"):
        transports = [args.transport]
    first = [
        f"preset {preset}" if preset else "preset unknown",
        f"page size {page_size}" if page_size else "preset's page size",
        f"concurrency {args.concurrency}",
        f"transport {'+'.join(transports) or 'unknown'}",
        (when or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M"),
    ]
    each = max((len(run.results) for run in runs), default=0)
    if getattr(args, "workload", "random") == "multiturn":
        second = (
            f"{args.conversations} conversations x {args.turns} turns, a system prompt of "
            f"{args.system_prompt_len} tokens, user messages of {args.user_len}, {args.max_new_tokens} new "
            f"tokens each, seed {args.seed}"
        )
    else:
        second = (
            f"{each} requests, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens each, seed {args.seed}"
        )
    labelled = [_label(run) for run in runs if run.label]
    if labelled:
        second += "; runs: " + ", then ".join(labelled)
    return "disagg bench: " + ", ".join(first) + "\n" + second


def _label(run: Run) -> str:
    return run.label.replace("_", " ")


def _bin_width(wall: float) -> float:
    """Seconds per throughput bin: 20 bins for a short run, 1 s bins (at most 200) for a long one."""
    return wall / 20 if wall <= 20 else max(1.0, wall / 200)


def throughput_bins(results: list[dict], finished: list[float], wall: float) -> dict:
    """Rates per time bin, each request counted in the bin where it completed: GB/s of KV
    bytes (successful requests) and requests/s, ok and failed apart."""
    width = _bin_width(wall) if wall > 0 else 1.0
    edges = np.arange(max(1, math.ceil(wall / width - 1e-9)) + 1) * width
    edges[-1] = max([edges[-1], wall, *finished])  # rounding must not drop the last completion
    times = np.asarray(finished, dtype=float)
    good = np.asarray([bool(r.get("ok")) for r in results], dtype=bool)
    nbytes = np.asarray([r.get("bytes", 0) if r.get("ok") else 0 for r in results], dtype=float)
    return {
        "width_s": width,
        "edges_s": edges,
        "gb_per_s": np.histogram(times, edges, weights=nbytes)[0] / width / 1e9,
        "ok_per_s": np.histogram(times[good], edges)[0] / width,
        "failed_per_s": np.histogram(times[~good], edges)[0] / width,
    }


def figure(runs: list[Run], title: str):
    """One row per run: a latency CDF per phase (left), and per time bin the GB/s and
    requests/s completed (right, one panel each: with one prompt length the two curves
    coincide). The latency panels share their x axis, so runs compare at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mosaic = [row for i in range(len(runs)) for row in ([f"lat{i}", f"gb{i}"], [f"lat{i}", f"req{i}"])]
    fig, ax = plt.subplot_mosaic(mosaic, figsize=(13, 6.5 * len(runs)), width_ratios=[1.2, 1])
    fig.suptitle(title, fontsize=10)
    for i, run in enumerate(runs):
        _latency(ax[f"lat{i}"], run)
        _throughput(ax[f"gb{i}"], ax[f"req{i}"], run)
        if i:
            ax[f"lat{i}"].sharex(ax["lat0"])
    fig.tight_layout()
    return fig


def _latency(ax, run: Run) -> None:
    import matplotlib.ticker

    ok = [r for r in run.results if r.get("ok")]
    for phase in PHASES:
        values = np.sort([v for r in ok if (v := r.get("timings_ms", {}).get(phase)) is not None and v > 0])
        if len(values):
            ax.step(
                values,
                np.arange(1, len(values) + 1) / len(values),
                where="post",
                label=phase,
                color=PHASE_COLOURS[phase],
            )
    ax.set(
        xscale="log",
        xlabel="latency (ms, log scale)",
        ylabel="fraction of successful requests",
        title="latency per phase (CDF)" + (f": {_label(run)}" if run.label else ""),
        ylim=(0, 1.02),
    )
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(True, which="both", alpha=0.3)
    if ok:
        ax.legend(fontsize=8, loc="best")


def _throughput(gb, req, run: Run) -> None:
    bins = throughput_bins(run.results, run.finished, run.wall)
    width = bins["width_s"]
    centers = bins["edges_s"][:-1] + width / 2
    gb.bar(centers, bins["gb_per_s"], width=width * 0.9, color="tab:blue")
    gb.set(
        ylabel="GB/s",
        title=f"KV bytes of requests completed per {width:.3g} s bin" + (f": {_label(run)}" if run.label else ""),
    )
    n_ok, n_failed = bins["ok_per_s"], bins["failed_per_s"]
    req.bar(centers, n_ok, width=width * 0.9, color="tab:green", label="ok")
    req.bar(centers, n_failed, width=width * 0.9, bottom=n_ok, color="tab:red", label="failed")
    req.set(xlabel="time since start (s)", ylabel="requests/s", title="requests completed per bin")
    req.legend(fontsize=8)
    req.sharex(gb)


def plot(runs: list[Run], path: str, title: str) -> None:
    """Write the figure of `runs` as a PNG at `path`, its title in the PNG's metadata too."""
    fig = figure(runs, title)  # (selects the Agg backend before pyplot is imported)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100, metadata={"Title": title.replace("\n", "; ")})
    plt.close(fig)
