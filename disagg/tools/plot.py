"""`--plot PNG` of `disagg bench` and `disagg demo`: a latency CDF per phase and the
throughput per time bin, titled with what ran (matplotlib, imported only when asked for)."""

import argparse
import datetime
import math

import numpy as np

from disagg.tools.bench import PHASES


def plot_title(args: argparse.Namespace, results: list[dict], when: datetime.datetime | None = None) -> str:
    """Two lines: what ran (preset, page size, concurrency, transport, date), then the workload."""
    preset, page_size = getattr(args, "preset", None), getattr(args, "page_size", None)
    transports = sorted({r["transport"] for r in results if r.get("transport")})
    if not transports and getattr(args, "transport", "auto") not in (None, "auto"):
        transports = [args.transport]
    first = [f"preset {preset}" if preset else "preset unknown",
             f"page size {page_size}" if page_size else "preset's page size",
             f"concurrency {args.concurrency}",
             f"transport {'+'.join(transports) or 'unknown'}",
             (when or datetime.datetime.now()).strftime("%Y-%m-%d %H:%M")]
    second = (f"{len(results)} requests, prompt {args.prompt_len} tokens, {args.max_new_tokens} new tokens each, "
              f"seed {args.seed}")
    return "disagg bench: " + ", ".join(first) + "\n" + second


def _bin_width(wall: float) -> float:
    """Seconds per throughput bin: 20 bins for a short run, 1 s bins (at most 200) for a long one."""
    return wall / 20 if wall <= 20 else max(1.0, wall / 200)


def throughput_bins(results: list[dict], finished: list[float], wall: float) -> dict:
    """Rates per time bin, each request counted in the bin where it completed: GB/s of KV
    bytes (successful requests) and requests/s, ok and failed apart."""
    width = _bin_width(wall) if wall > 0 else 1.0
    edges = np.arange(max(1, math.ceil(wall / width - 1e-9)) + 1) * width
    edges[-1] = max([edges[-1], wall, *finished])   # rounding must not drop the last completion
    times = np.asarray(finished, dtype=float)
    good = np.asarray([bool(r.get("ok")) for r in results], dtype=bool)
    nbytes = np.asarray([r.get("bytes", 0) if r.get("ok") else 0 for r in results], dtype=float)
    return {"width_s": width, "edges_s": edges,
            "gb_per_s": np.histogram(times, edges, weights=nbytes)[0] / width / 1e9,
            "ok_per_s": np.histogram(times[good], edges)[0] / width,
            "failed_per_s": np.histogram(times[~good], edges)[0] / width}


def plot(results: list[dict], finished: list[float], wall: float, path: str, title: str) -> None:
    """One PNG: a latency CDF per phase (left), and per time bin the GB/s and requests/s
    completed (right, one panel each: with one prompt length the two curves coincide)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplot_mosaic([["lat", "gb"], ["lat", "req"]], figsize=(13, 6.5), width_ratios=[1.2, 1])
    fig.suptitle(title, fontsize=10)
    ok = [r for r in results if r.get("ok")]
    for phase in PHASES:
        values = np.sort([v for r in ok if (v := r.get("timings_ms", {}).get(phase)) is not None and v > 0])
        if len(values):
            ax["lat"].step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=phase)
    ax["lat"].set(xscale="log", xlabel="latency (ms, log scale)", ylabel="fraction of successful requests",
                  title="latency per phase (CDF)", ylim=(0, 1.02))
    ax["lat"].xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax["lat"].grid(True, which="both", alpha=0.3)
    if ok:
        ax["lat"].legend(fontsize=8, loc="best")

    bins = throughput_bins(results, finished, wall)
    width = bins["width_s"]
    centers = bins["edges_s"][:-1] + width / 2
    ax["gb"].bar(centers, bins["gb_per_s"], width=width * 0.9, color="tab:blue")
    ax["gb"].set(ylabel="GB/s", title=f"KV bytes of requests completed per {width:.3g} s bin")
    n_ok, n_failed = bins["ok_per_s"], bins["failed_per_s"]
    ax["req"].bar(centers, n_ok, width=width * 0.9, color="tab:green", label="ok")
    ax["req"].bar(centers, n_failed, width=width * 0.9, bottom=n_ok, color="tab:red", label="failed")
    ax["req"].set(xlabel="time since start (s)", ylabel="requests/s", title="requests completed per bin")
    ax["req"].legend(fontsize=8)
    ax["req"].sharex(ax["gb"])
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title.replace("\n", "; ")})
    plt.close(fig)
