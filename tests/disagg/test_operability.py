"""What a person running the processes sees (issue 16), through the real console script: a
decode with a wrong --bootstrap-addr says why it is not ready (in /ready and in its log) and
prints its ready lines only once /ready is true; a worker's start-up is quiet at the default
log level and states its pool's size before allocating; `disagg demo` ends the processes it
started on SIGTERM, with no traceback."""

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from harness.processes import reap, spawn

DISAGG = str(Path(sys.executable).with_name("disagg"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    return spawn([DISAGG, *args, "--insecure"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _ready(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM, and what it said; its group is killed whatever happens (a hung stop included)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    finally:
        reap(proc)


def test_decode_with_a_wrong_bootstrap_says_why_and_is_not_announced(eventually):
    wrong, http = f"tcp://127.0.0.1:{_free_port()}", _free_port()
    decode = _start(
        "decode", "--preset", "tiny-full", "--max-tokens", "1024", "--bootstrap-addr", wrong, "--http-port", str(http)
    )
    try:
        url = f"http://127.0.0.1:{http}"
        eventually(lambda: _ready(url)[0] == 503, 60, "decode serves /ready")
        status, body = _ready(url)
        assert body["ready"] is False and wrong in body["why"] and "--bootstrap-addr" in body["why"]
        assert select.select([decode.stdout], [], [], 0)[0] == []  # no "ready" line while /ready is false
    finally:
        out, err = _stop(decode)
    assert out == ""
    assert f"not ready: bootstrap {wrong} did not answer" in err and "Traceback" not in err


def test_a_worker_starts_quietly_and_states_its_pool_first():
    prefill = _start(
        "prefill",
        "--preset",
        "tiny-hybrid",
        "--max-tokens",
        "4096",
        "--max-requests",
        "8",
        "--bootstrap-bind",
        "tcp://127.0.0.1:0",
    )
    try:
        line = json.loads(prefill.stdout.readline())
    finally:
        out, err = _stop(prefill)
    assert line["role"] == "prefill" and line["pool"]["device"] == "cpu"
    assert line["pool"]["bytes"] >= sum(line["pool"]["components"].values()) > 0
    said = err.splitlines()
    pool = next(i for i, l in enumerate(said) if "pool tiny-hybrid: " in l)
    ready = next(i for i, l in enumerate(said) if l.startswith("disagg prefill ready on http://127.0.0.1:"))
    assert pool < ready and "full " in said[pool] and "8 request slots" in said[pool]
    for noise in ("InitGoogleLogging", "Local segment descriptor", "No RDMA devices", "Traceback"):
        assert noise not in err, err


def test_debug_log_level_shows_the_transfer_engine_start_up():
    prefill = _start(
        "prefill",
        "--preset",
        "tiny-full",
        "--max-tokens",
        "1024",
        "--bootstrap-bind",
        "tcp://127.0.0.1:0",
        "--log-level",
        "debug",
    )
    try:
        prefill.stdout.readline()
    finally:
        _, err = _stop(prefill)
    assert "Local segment descriptor" in err
    froze = re.search(r"froze (\d+) objects out of the collector's passes", err)  # (disagg.process.freeze_heap)
    assert froze and int(froze[1]) > 10_000, err[-2000:]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_demo_ends_its_processes_on_sigterm_without_a_traceback(eventually):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    demo = spawn(
        [DISAGG, "demo", "--requests", "100000", "--prompt-len", "16:64", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for line in demo.stderr:  # progress: one line per process as it comes up
            if "router ready on" in line:
                break
        children = _children(demo.pid)
        assert len(children) == 3
        demo.send_signal(signal.SIGTERM)
        out, err = demo.communicate(timeout=90)
        assert demo.returncode == 130 and "disagg demo: interrupted" in err and "Traceback" not in err
        eventually(lambda: all(_gone(pid) for pid in children), 30, "the demo's prefill, decode and router ended")
    finally:
        reap(demo)  # (its group: the demo, and what it left behind if this failed)


def test_a_worker_says_at_once_that_it_stops_and_exits_without_its_teardown():
    """Issue 36, item 10: SIGTERM to an idle worker took 4-18 s (Ctrl-C up to 55 s) with no
    word: the interpreter collected the worker's objects at exit. Now it says it stops at once
    and exits as soon as it has closed what it holds."""
    proc = _start(
        "prefill",
        "--preset",
        "tiny-full",
        "--device",
        "cpu",
        "--max-tokens",
        "4096",
        "--bootstrap-bind",
        "tcp://127.0.0.1:0",
    )
    try:
        assert select.select([proc.stdout], [], [], 60)[0] and json.loads(proc.stdout.readline())["role"] == "prefill"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and "SIGTERM: stopping" in err and "Traceback" not in err, err[-2000:]
