"""End to end: two vLLM api_servers (tiny random-weight Llama, CPU) with DisaggConnector, a
producer and a consumer, behind vLLM's own toy proxy (from its 0.32.0 sdist, as scripts/setup.sh
extracts it): greedy completions through the pair are token-identical to the consumer computing
the same prompts itself (prefix caching off, so nothing of the transfer is reused).

Servers start once for the module (~75 s on 2 cores). vLLM's CPU workers pin themselves to
core 0 unless told otherwise (VLLM_CPU_OMP_THREADS_BIND); two servers on one core starve the
transfer's threads, so each gets a core of its own where the machine has two."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_TESTS = Path(os.environ.get("DISAGG_VLLM_TESTS", Path(sys.prefix) / "vllm-sdist-tests"))
PROXY = VLLM_TESTS / "tests" / "v1" / "kv_connector" / "nixl_integration" / "toy_proxy_server.py"
READY_S = 400.0
PROMPTS = [" ".join(f"w{(i * 37 + k * 11) % 500 + 3}" for i in range(n)) for k, n in ((1, 42), (2, 100), (3, 7))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(model: Path, port: int, role: str, extra: dict, core: str, log) -> subprocess.Popen:
    kv = {"kv_connector": "DisaggConnector", "kv_connector_module_path": "disagg.vllm.connector", "kv_role": role,
          "kv_connector_extra_config": extra}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core,
           "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.2",
                             "--max-model-len", "512", "--block-size", "32", "--dtype", "float32",
                             "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kv)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_ready(procs: dict, urls: list[str], logs: Path) -> None:
    give_up = time.monotonic() + READY_S
    while not all(_up(u) for u in urls):
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > give_up:
            tails = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in logs.iterdir())
            raise AssertionError(f"not ready ({'exited: ' + ', '.join(dead) if dead else 'timeout'}):\n{tails}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    """(proxy URL, consumer URL)."""
    logs = tmp_path_factory.mktemp("e2e-logs")
    cores = sorted(os.sched_getaffinity(0))
    p_port, d_port, x_port, boot = _free_port(), _free_port(), _free_port(), _free_port()
    files = {n: (logs / f"{n}.log").open("w") for n in ("prefill", "decode", "proxy")}
    procs = {
        "prefill": _server(tiny_llama, p_port, "kv_producer", {"bootstrap": f"tcp://127.0.0.1:{boot}"},
                           str(cores[0]), files["prefill"]),
        "decode": _server(tiny_llama, d_port, "kv_consumer", {"load_s": 20}, str(cores[-1]), files["decode"]),
        "proxy": subprocess.Popen([sys.executable, str(PROXY), "--port", str(x_port), "--prefiller-host", "127.0.0.1",
                                   "--prefiller-port", str(p_port), "--decoder-host", "127.0.0.1", "--decoder-port",
                                   str(d_port)], stdout=files["proxy"], stderr=subprocess.STDOUT,
                                  start_new_session=True),
    }
    try:
        _wait_ready(procs, [f"http://127.0.0.1:{p_port}/health", f"http://127.0.0.1:{d_port}/health",
                            f"http://127.0.0.1:{x_port}/healthcheck"], logs)
        yield f"http://127.0.0.1:{x_port}", f"http://127.0.0.1:{d_port}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files.values():
            f.close()


def _complete(base: str, model: Path, prompt: str) -> str:
    body = json.dumps({"model": str(model), "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_pd_through_the_proxy_is_token_identical_to_computing_locally(pair, tiny_llama):
    proxy, decode = pair
    for prompt in PROMPTS:
        assert _complete(proxy, tiny_llama, prompt) == _complete(decode, tiny_llama, prompt), prompt
