"""`disagg bench --workload multiturn` and `disagg demo --workload multiturn` with real
processes on loopback (stand-in engine, Mooncake): one prefill feeds two decodes, prefix cache
on and off, each behind its own router; the same conversations run through both. With reuse
on a later turn moves only what decode lacks (its system prompt and the turns before are
decode's own), with it off the whole prompt moves, and what did not move is exactly the
difference. Prefill's own prefix cache (on in the shared prefill) computes only what follows
what it computed before; the demo's stacks each have their own prefill, caches on and off."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher

pytestmark = pytest.mark.slow

DISAGG = str(Path(sys.executable).with_name("disagg"))
PAGE, SYSTEM, USER, ANSWER = 4, 64, 40, 5
WORKLOAD = [
    "--workload",
    "multiturn",
    "--conversations",
    "2",
    "--turns",
    "3",
    "--system-prompt-len",
    str(SYSTEM),
    "--user-len",
    str(USER),
    "--max-new-tokens",
    str(ANSWER),
    "--no-progress",
]


@pytest.fixture(scope="module")
def routers():
    """Router URLs: reuse on, reuse off (the same prefill behind both)."""
    common = [
        "--preset",
        "tiny-hybrid",
        "--device",
        "cpu",
        "--max-requests",
        "8",
        "--max-tokens",
        "4096",
        "--page-size",
        str(PAGE),
        "--staging-slot-mib",
        "1",
    ]
    with Launcher() as launcher:
        prefill = launcher.start_instance("prefill", 1, *common, "--bootstrap-bind", "tcp://127.0.0.1:*")
        out = []
        for cache in ("--prefix-cache", "--no-prefix-cache"):
            decode = launcher.start_instance("decode", 1, *common, cache, "--bootstrap-addr", prefill[0]["bootstrap"])
            out.append(
                launcher.start("router", "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}")["http"]
            )
        yield out


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DISAGG, "bench", *args], capture_output=True, text=True, timeout=180)


def test_later_turns_move_only_what_decode_lacks_with_reuse_on_and_everything_with_it_off(routers):
    on_url, off_url = routers
    done = bench("--router", on_url, "--compare-router", off_url, "--concurrency", "1", "--json", *WORKLOAD)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["workload"] == {
        "conversations": 2,
        "turns": 3,
        "system_prompt_tokens": SYSTEM,
        "user_tokens": str(USER),
        "answer_tokens": ANSWER,
        "seed": 0,
    }
    on, off = out["runs"]["reuse_on"], out["runs"]["reuse_off"]
    for run in (on, off):
        assert run["requests"] == run["verified"] == 6 and run["failed"] == 0
        assert {
            "hit_rate",
            "bytes_per_request",
            "reused_bytes_per_request",
            "transfer_ms",
            "ttft_ms",
            "per_turn",
            "per_request",
        } <= set(run)
        assert {"p50", "p90", "mean"} == set(run["ttft_ms"]) == set(run["transfer_ms"])
        assert [t["turn"] for t in run["per_turn"]] == [1, 2, 3]
    pairs = list(zip(on["per_request"], off["per_request"], strict=True))
    for a, b in pairs:  # the same conversations went through both (the stand-in answers alike)
        assert (a["conversation"], a["turn"], a["prompt_tokens"]) == (b["conversation"], b["turn"], b["prompt_tokens"])
        assert b["prefix_tokens"] == b["reused_bytes"] == 0 and b["hit_rate"] == 0
        assert a["bytes"] + a["reused_bytes"] == b["bytes"], (a, b)  # what did not move is the difference
        assert {"ttft_ms", "transfer_ms", "hit_rate"} <= set(a) and a["ttft_ms"] > 0
    first, second = pairs[0][0], pairs[1][0]  # conversation 0, turns 1 and 2
    assert first["prefix_tokens"] == 0
    assert second["prefix_tokens"] == (first["prompt_tokens"] + ANSWER - 1) // PAGE * PAGE  # turn 1's pages
    assert second["bytes"] < pairs[1][1]["bytes"] / 2  # (the GDN state and AUX row still move whole)
    other = next(a for a, _ in pairs if a["conversation"] == 1 and a["turn"] == 1)
    assert other["prefix_tokens"] == SYSTEM  # the shared system prompt, from conversation 0
    assert off["hit_rate"] == 0 < on["hit_rate"] and out["reuse_on_vs_off"]["bytes_fewer_x"] > 2
    # the prefill both routers share caches: each turn after the first of a conversation skips
    # the whole pages of the prompt before it, in either run (the other run computed them first)
    assert on["prefill_cache"] == off["prefill_cache"] == "on"
    for a, b in pairs:
        assert a["turn"] == 1 or a["prefill_cached_tokens"] >= SYSTEM, a
        assert a["compute_ms"] > 0 and b["compute_ms"] > 0


def test_the_table_puts_reuse_on_and_off_side_by_side(routers):
    done = bench("--router", routers[0], "--compare-router", routers[1], *WORKLOAD)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("turn "))
    rows = [line for line in lines if line.split(" ")[0] in ("1", "2", "3", "all")]
    assert [r.split()[0] for r in rows] == ["1", "2", "3", "all"]
    assert {len(r) for r in rows} == {len(header.rstrip())}, "\n".join([header, *rows])
    assert "reuse on" in lines[1] and "reuse off" in lines[1]
    assert any(line.startswith("reuse off -> on: ") and "fewer" in line for line in lines), done.stdout


def test_the_demo_runs_it_through_two_stacks_of_its_own():
    done = subprocess.run(
        [DISAGG, "demo", "--max-tokens", "4096", "--page-size", str(PAGE), "--json", "--concurrency", "2", *WORKLOAD],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert set(out["runs"]) == {"reuse_on", "reuse_off"} and out["workload"]["preset"] == "tiny-hybrid"
    assert out["runs"]["reuse_on"]["hit_rate"] > 0 == out["runs"]["reuse_off"]["hit_rate"]
    on, off = out["runs"]["reuse_on"], out["runs"]["reuse_off"]  # both caches on, both off
    assert (on["prefill_cache"], off["prefill_cache"]) == ("on", "off")
    assert on["prefill_hit_rate"] > 0 == off["prefill_hit_rate"]
    assert all(run["verified"] == 6 for run in out["runs"].values())
