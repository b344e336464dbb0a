"""A wrongly paired deployment shows before any request is sent (issue 36, items 2 and 5):
prefill and decode of different models (tiny-hybrid vs tiny-mamba). Decode registers with its
prefill at start-up, so it turns unready with the difference as its reason, prefill logs the
refusal at WARNING, the router's /ready shows the pair down with decode's reason, and a
request is refused at once with 503 and that reason. Real processes."""

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from harness.processes import reap, spawn

DISAGG = str(Path(sys.executable).with_name("disagg"))
COMMON = ["--device", "cpu", "--max-tokens", "4096", "--insecure"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def _ready_line(proc: subprocess.Popen) -> dict:
    assert select.select([proc.stdout], [], [], 90)[0], "no ready line within 90 s"
    return json.loads(proc.stdout.readline())


def test_a_pair_of_different_models_is_down_before_any_request(eventually, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    log = (tmp_path / "prefill.log").open("w")
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    prefill = spawn(
        [DISAGG, "prefill", "--preset", "tiny-hybrid", *COMMON, "--bootstrap-bind", "tcp://127.0.0.1:0"],
        **{**pipes, "stderr": log},
    )
    decode = router = None
    try:
        p = _ready_line(prefill)
        decode_url = f"http://127.0.0.1:{_free_port()}"
        decode = spawn(
            [
                DISAGG,
                "decode",
                "--preset",
                "tiny-mamba",
                *COMMON,
                "--bootstrap-addr",
                p["bootstrap"],
                "--http-port",
                decode_url.rsplit(":", 1)[1],
            ],
            **pipes,
        )
        eventually(
            lambda: "layout mismatch" in _get(decode_url + "/ready")[1].get("why", ""),
            60,
            "decode unready with the layout difference",
        )
        status, ready = _get(decode_url + "/ready")
        assert status == 503 and "tiny-hybrid vs decode tiny-mamba" in ready["why"], ready
        router = spawn([DISAGG, "router", "--pair", f"{p['http']},{decode_url},{p['bootstrap']}"], **pipes)
        r = _ready_line(router)
        status, body = _get(r["http"] + "/ready")
        assert status == 503 and "layout mismatch" in " ".join(body["pairs"][0]["why"]), body
        t0 = time.monotonic()
        req = urllib.request.Request(r["http"] + "/generate", b'{"prompt_len": 8}')
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("a request to a pair that is down was served")
        except urllib.error.HTTPError as exc:
            code, out = exc.code, json.loads(exc.read())
        assert code == 503 and "layout mismatch" in out["reason"] and time.monotonic() - t0 < 5, out
    finally:
        for proc in (router, decode, prefill):
            if proc is not None:
                reap(proc)
        log.close()
    logged = (tmp_path / "prefill.log").read_text()
    assert (
        "WARNING refused a decode's registration: layout mismatch: prefill tiny-hybrid vs decode tiny-mamba" in logged
    ), logged[-3000:]


def test_prefill_and_decode_computing_prompts_in_other_passes_are_refused_naming_both(eventually):
    """--prefill-chunk on both roles is part of the model's identity: decode caches a prompt's
    whole chunks and checks against the colocated run in its own passes, so a prefill of
    16-token passes and a decode of one pass are a pair that is down, and say both values."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    model = ["--preset", "tiny-model-gpt-oss", "--engine", "model", *COMMON]
    prefill = spawn(
        [DISAGG, "prefill", *model, "--prefill-chunk", "16", "--bootstrap-bind", "tcp://127.0.0.1:0"], **pipes
    )
    decode = None
    try:
        p = _ready_line(prefill)
        decode_url = f"http://127.0.0.1:{_free_port()}"
        decode = spawn(
            [DISAGG, "decode", *model, "--prefill-chunk", "0", "--bootstrap-addr", p["bootstrap"]]
            + ["--http-port", decode_url.rsplit(":", 1)[1]],
            **pipes,
        )
        eventually(
            lambda: "layout mismatch" in _get(decode_url + "/ready")[1].get("why", ""),
            120,
            "decode unready with the difference",
        )
        status, ready = _get(decode_url + "/ready")
        assert (
            status == 503
            and (
                "prefill chunk (--prefill-chunk): prefill 16 tokens, decode 0 (one pass) "
                "(both sides must compute prompts in the same passes)"
            )
            in ready["why"]
        ), ready
    finally:
        for proc in (decode, prefill):
            if proc is not None:
                reap(proc)
