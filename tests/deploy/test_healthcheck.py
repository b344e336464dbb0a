"""The images' health check (deploy/docker/healthcheck.py), run as Docker runs it, a separate
Python process, against a real disagg HTTP server: healthy only on 200 from /health of the port
the server's command line (or DISAGG_HTTP_PORT) names, one line saying why otherwise."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"


def check(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env={**clean, **(env or {})}, timeout=30
    )
    assert run.stderr == "" or run.returncode != 0, run.stderr
    return run.returncode, (run.stdout + run.stderr).strip()


@pytest.fixture
def server():
    state = {"status": "ok"}
    api = ApiServer(
        ("127.0.0.1", 0), Service({}, lambda: True, CollectorRegistry(), health=lambda: dict(state))
    ).start()
    yield api, state
    api.stop()


def test_a_server_answering_200_is_healthy(server):
    api, _ = server
    code, out = check("/opt/venv/bin/disagg", "router", "--http-host", "0.0.0.0", "--http-port", str(api.port))
    assert code == 0 and out.startswith("healthy: disagg router answered 200"), out


def test_the_port_may_come_from_the_environment(server):
    api, _ = server
    code, out = check("disagg", "prefill", "--preset", "tiny-full", env={"DISAGG_HTTP_PORT": str(api.port)})
    assert code == 0 and f":{api.port}/health" in out, out


def test_a_server_answering_503_is_unhealthy_and_says_why(server):
    api, state = server
    state.update(status="unhealthy", dead_threads=["loop"])
    code, out = check("disagg", "decode", f"--http-port={api.port}")
    assert code == 1 and out.startswith("unhealthy: disagg decode answered 503") and "loop" in out, out
    assert "\n" not in out


def test_no_answer_is_unhealthy():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out = check("disagg", "router", "--http-port", str(port))
    assert code == 1 and out.startswith("unhealthy: no answer from disagg router") and "\n" not in out, out


def test_a_server_without_a_fixed_port_cannot_be_checked():
    code, out = check("disagg", "decode", "--http-port", "0")
    assert code == 1 and "no fixed HTTP port" in out and "\n" not in out, out


def test_commands_without_http_are_healthy_while_they_run():
    code, out = check("disagg", "bootstrap", "--bootstrap-bind", "tcp://0.0.0.0:8998")
    assert code == 0 and out == "healthy: disagg bootstrap serves no HTTP", out
