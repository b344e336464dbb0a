"""bench's summary: what `disagg demo` and `disagg bench` print and exit on, and how a run
that is interrupted ends."""

import argparse
import json
import re
import threading

import pytest

from disagg.tools import bench
from disagg.tools.bench import PHASE_MEANING, PHASES, mismatches, print_summary, run_workload, summarize


def ok_result(total: float, transport: str = "mooncake", mode: str = "direct") -> dict:
    timings = {phase: total / (i + 2) for i, phase in enumerate(PHASES)}
    timings["total"] = total
    return {
        "ok": True,
        "verified": True,
        "bytes": 3_000_000,
        "mode": mode,
        "transport": transport,
        "timings_ms": timings,
    }


def test_bench_counts_a_checked_generation_that_differs_as_a_failure():
    """The demo's and bench's exit code: a logits-only difference counts, like a token one."""
    same = {"token_match": True, "logits_match": True}
    results = [
        {"ok": True, "verified": True, "bytes": 1, "timings_ms": {"total": 1.0}, "check": c}
        for c in (same, same, {"token_match": True, "logits_match": False}, None)
    ]
    summary = summarize(results, 1.0)
    assert summary["token_match"] == {
        "checked": 3,
        "match": 3,
        "logits_checked": 3,
        "logits_match": 2,
        "shard_checked": 0,
        "shard_match": 0,
        "differ": 1,
    }
    assert mismatches(summary) == 1
    assert mismatches(summarize(results[:2], 1.0)) == 0
    token_differs = summarize(
        [{"ok": True, "timings_ms": {}, "check": {"token_match": False, "first_mismatch": 2}}], 1.0
    )
    assert mismatches(token_differs) == 1  # a stand-in check (no logits) that differs counts too


def test_a_stand_in_check_is_said_to_compare_tokens_only(capsys):
    """Issue 36: the stand-in engine has no logits, yet the summary said "logits bit-identical
    4/4". What the stand-in's check returns: token_match and first_mismatch, nothing more."""
    standin = {"token_match": True, "first_mismatch": None}
    print_summary(summarize([{**ok_result(5.0), "check": standin}] * 4, 1.0))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("token_match"))
    assert line.startswith("token_match 4/4") and "bit-identical" not in line and "tokens only" in line, line
    model = {"token_match": True, "logits_match": True, "max_logit_diff": 0.0}
    summary = summarize([{**ok_result(5.0), "check": c} for c in (model, model, standin)], 1.0)
    assert summary["token_match"]["logits_checked"] == 2 and summary["token_match"]["logits_match"] == 2
    print_summary(summary)
    assert "logits bit-identical 2/2" in capsys.readouterr().out


def test_failure_reasons_are_kept_whole_and_grouped():
    why = "decode failed: prefill layout differs: " + "x" * 300 + " (head_dim x kv_heads: prefill 64x8, decode 64x12)"
    summary = summarize(
        [{"ok": False, "reason": why}, {"ok": False, "reason": why}, {"status": 503, "error": "busy"}], 1.0
    )
    assert summary["failures"] == {why: 2, "busy": 1} and summary["failed"] == 3


def test_one_cause_in_many_rooms_is_one_line_with_example_rooms(capsys):
    """Issue 36: each reason carried its room, so 40 requests refused for one cause printed
    40 lines. The room number leaves the grouping key; a few rooms stay as examples."""
    results = [
        {
            "ok": False,
            "status": 503,
            "room": 7000 + i,
            "reason": f"decode: prefill refused the connection (room {7000 + i}, pair 0)",
        }
        for i in range(40)
    ]
    results += [
        {"ok": False, "reason": "prefill failed: room 12: the router says decode TP size 2, decode's request 1"}
    ]
    summary = summarize(results + [ok_result(4.0)], 1.0)
    assert summary["failures"] == {
        "decode: prefill refused the connection (room *, pair 0)": 40,
        "prefill failed: room *: the router says decode TP size 2, decode's request 1": 1,
    }
    assert summary["failure_rooms"] == {
        "decode: prefill refused the connection (room *, pair 0)": [7000, 7001, 7002],
        "prefill failed: room *: the router says decode TP size 2, decode's request 1": [12],
    }
    print_summary(summary)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if " x " in line]
    assert lines == [
        "40 x decode: prefill refused the connection (room *, pair 0)  [rooms 7000, 7001, 7002, ...]",
        " 1 x prefill failed: room *: the router says decode TP size 2, decode's request 1  [rooms 12]".strip(),
    ]


def test_json_keys_name_their_unit():
    summary = summarize([ok_result(10.0), ok_result(20.0)], 2.0)
    assert summary["gb_per_s"] == pytest.approx(6e6 / 2.0 / 1e9)
    transfer_s = sum(r["timings_ms"]["transfer"] for r in (ok_result(10.0), ok_result(20.0))) / 1e3
    assert summary["transfer_gb_per_s"] == pytest.approx(6e6 / transfer_s / 1e9, rel=1e-4)
    assert not {"gbps", "transfer_gbps"} & set(summary)
    assert "gbps" not in json.dumps(summary)


def test_the_table_has_one_decimal_no_dict_reprs_and_a_legend_for_every_phase(capsys):
    results = [ok_result(12.345), ok_result(40.0), ok_result(7.0, transport="cuda-ipc", mode="staged")]
    print_summary(summarize(results, 0.5))
    out = capsys.readouterr().out
    assert "{" not in out and "}" not in out
    assert "modes: direct 2, staged 1" in out and "transports: mooncake 2, cuda-ipc 1" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] and line.split()[0] in PHASES and len(line.split()) == 5
    ]
    assert [r[0] for r in rows] == list(PHASES)
    assert all(re.fullmatch(r"-?\d+\.\d", cell) for r in rows for cell in r[1:]), rows
    for phase in PHASES:  # every phase in the table is explained, in one line of its own
        assert (
            sum(1 for line in out.splitlines() if line.split()[:1] == [phase] and PHASE_MEANING[phase] in line) == 1
        ), phase
    # rates: a few significant figures, never 6 decimals or exponents
    assert "0.0180 GB/s aggregate" in out and "e-0" not in out


def test_the_table_stays_aligned_whatever_the_phase_names(capsys):
    """Issue 36: "kv_ready_after_compute" and "transfer_cpu" pushed their rows right of the
    header. Every row's columns end where the header's do."""
    print_summary(summarize([ok_result(12.3), ok_result(40.0)], 0.5))
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("phase "))
    end = header.index("mean ms") + len("mean ms")
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in PHASES and len(line.split()) == 5]
    assert len(rows) == len(PHASES) and "kv_ready_after_compute" in {r.split()[0] for r in rows}
    for name in ("p50 ms", "p90 ms", "p99 ms"):  # each number ends under its heading
        col = header.index(name) + len(name)
        assert {row[:col].rstrip()[-1:].isdigit() and row[col : col + 1] == " " for row in rows} == {True}, name
    assert {len(row) for row in rows} == {end}, (header, rows)


def test_when_every_request_failed_it_says_so_and_lists_the_reasons(capsys):
    long_reason = "prefill failed: TransferError: " + "y" * 250 + " (peer 10.0.0.2 reset the connection)"
    results = [{"ok": False, "reason": long_reason}] * 3 + [{"status": 503, "error": "busy"}] * 5
    print_summary(summarize(results, 0.016))
    out = capsys.readouterr().out
    assert "all 8 requests failed" in out
    assert "req/s" not in out and "GB/s" not in out and "p50" not in out
    lines = [line.strip() for line in out.splitlines()]
    assert "5 x busy" in lines and f"3 x {long_reason}" in lines  # whole, most frequent first
    assert lines.index("5 x busy") < lines.index(f"3 x {long_reason}")


def test_when_some_failed_the_reasons_follow_the_table_grouped(capsys):
    results = [ok_result(5.0)] * 3 + [{"ok": False, "reason": "decode failed: verify: digest"}] * 2
    print_summary(summarize(results, 1.0))
    out = capsys.readouterr().out
    assert "2 of 5 requests failed" in out and "2 x decode failed: verify: digest" in out
    assert out.index("p50 ms") < out.index("2 of 5 requests failed")


def test_every_bench_flag_has_help_with_its_unit_and_no_default_of_its_own():
    p = argparse.ArgumentParser()
    bench.add_parser(p)
    flags = {a.dest: a for a in p._actions if a.option_strings and a.dest != "help"}
    assert set(flags) >= {
        "router",
        "requests",
        "concurrency",
        "prompt_len",
        "max_new_tokens",
        "seed",
        "plot",
        "no_progress",
        "json",
    }
    for dest, a in flags.items():
        assert a.help and "default" not in a.help.lower(), dest  # defaults are appended by disagg.config
    units = {
        "requests": "count",
        "concurrency": "count",
        "prompt_len": "tokens",
        "max_new_tokens": "tokens",
        "seed": "integer",
        "plot": "PNG",
        "router": "URL",
    }
    for dest, unit in units.items():
        assert unit in flags[dest].help, (dest, flags[dest].help)
    args = p.parse_args(["--router", "http://r", "--seed", "7", "--prompt-len", "8:16"])
    assert (args.seed, args.prompt_len, args.requests) == (7, "8:16", 32)


@pytest.mark.parametrize("error", [ConnectionRefusedError("router went away"), KeyboardInterrupt()])
def test_an_error_mid_run_cancels_the_queued_requests_and_closes_the_bar(monkeypatch, error):
    """Ctrl-C or an exception: the requests not sent yet are dropped, not awaited one by one."""
    sent, release, bars = [], threading.Event(), []

    def post(url, body, timeout):
        sent.append(body["seed"])
        if len(sent) == 1:
            raise error
        if len(sent) == 2:  # in flight when the error comes up: it must not hold the caller
            release.wait(10)
        return {"ok": True, "bytes": 0, "timings_ms": {}}

    class Bar:
        def __init__(self, *args, **kwargs):
            self.closed = False
            bars.append(self)

        def update(self, n):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setattr(bench, "post_json", post)
    monkeypatch.setattr(bench, "tqdm", Bar)
    args = argparse.Namespace(
        seed=0, prompt_len="4", requests=50, concurrency=1, max_new_tokens=1, no_progress=True, plot=None
    )
    try:
        with pytest.raises(type(error)):
            run_workload("http://router", args)
        assert len(sent) <= 2, f"{len(sent)} of 50 requests sent: the queued ones were not cancelled"
        assert bars and bars[0].closed
    finally:
        release.set()
