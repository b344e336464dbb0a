"""/health tells the truth: a process whose control loop died answers 503 "unhealthy" naming
the thread (an orchestrator restarts it) instead of serving half-alive; a second live prefill
of a rank is refused at start with a clear error."""

import json
import logging
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.bootstrap.server import BootstrapConfig, BootstrapServer
from disagg.control.auth import AuthKey, Gate
from disagg.control.messages import PROTOCOL_VERSION, RegisterPrefill, Registered, encoder
from disagg.errors import ConfigError
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings

POOL = PoolSettings(preset="tiny-full", max_tokens=1024, max_requests=2, device="cpu")


def _health(api: ApiServer) -> tuple[int, dict]:
    return _get(api, "/health")


def _get(api: ApiServer, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop dies on purpose
def test_a_dead_control_loop_makes_the_process_unhealthy(eventually):
    prefill = PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind="tcp://127.0.0.1:*"))
    api = ApiServer(("127.0.0.1", 0), Service({}, lambda: True, CollectorRegistry(), health=prefill.health)).start()
    try:
        status, health = _health(api)
        assert status == 200 and health["status"] == "ok" and health["role"] == "prefill", health
        assert health["preset"] == "tiny-full" and health["auth"] == "insecure" and health["transports"]

        def broken(timeout_ms):  # what a ZMQ error inside the loop's socket does
            raise zmq.ZMQError(zmq.EFSM)

        prefill.io.recv = broken
        eventually(lambda: _health(api)[0] == 503, 10, "/health answers 503")
        assert _health(api)[1]["dead_threads"] == ["loop"]
    finally:
        api.stop()
        prefill.close()


def test_a_second_live_prefill_of_a_rank_is_refused_at_start():
    first = PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind="tcp://127.0.0.1:*"))
    try:
        with pytest.raises(ConfigError, match="rank 0 is held by a live prefill at " + first.control_endpoint):
            PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind=None, bootstrap_addr=first.bootstrap_endpoint))
        assert first.bootstrap.ranks[0].control_endpoint == first.control_endpoint
    finally:
        first.close()


def test_a_prefill_whose_rank_was_taken_says_so_and_is_not_ready(eventually, caplog):
    """Issue 35, item 6: a bootstrap restarted and a key holder took rank 0 before the live
    prefill renewed; the prefill logged one warning and its /health and /ready stayed "ok", while
    decode was sent to the other holder. Now: an ERROR, and /ready false with the reason;
    /health stays ok (a restart cannot take the rank from a live holder) and shows the lease."""
    caplog.set_level(logging.INFO, "disagg.bootstrap")
    gate = Gate(zmq.Context(), AuthKey(), "test")  # (in-process servers hold no key)
    first = BootstrapServer(BootstrapConfig("tcp://127.0.0.1:*", grace_s=0), gate).start()
    prefill = PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind=None, bootstrap_addr=first.endpoint))
    api = ApiServer(
        ("127.0.0.1", 0), Service({}, prefill.readiness, CollectorRegistry(), health=prefill.health)
    ).start()
    second = None
    try:
        assert _get(api, "/ready")[0] == 200
        first.stop()
        # the restarted bootstrap (as before issue 35: no grace period) is taken before the renewal comes
        restarted: list[BootstrapServer] = []  # (ZMQ lets the port go in its own thread, soon)
        eventually(lambda: _bind(restarted, BootstrapConfig(first.endpoint, grace_s=0), gate), 10, "the port freed")
        second = restarted[0]
        impostor = RegisterPrefill(PROTOCOL_VERSION, 0, 1, "tcp://127.0.0.1:9", prefill.epoch + 1, prefill.layout)
        assert isinstance(second.handle(encoder.encode(impostor)), Registered)
        second.start()
        eventually(lambda: _get(api, "/ready")[0] == 503, 10, "/ready turns 503")
        status, ready = _get(api, "/ready")
        assert "no longer lists this prefill as rank 0" in ready["why"] and "tcp://127.0.0.1:9" in ready["why"]
        status, health = _get(api, "/health")
        assert status == 200 and health["status"] == "ok" and health["bootstrap_lease"].startswith("lost: "), health
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "disagg.bootstrap.lease"]
        assert len(errors) == 1 and "rank 0 is no longer this prefill's" in errors[0].getMessage()
    finally:
        api.stop()
        prefill.close()
        if second is not None:
            second.stop()
        gate.close()
        gate.ctx.destroy(linger=0)


def _bind(into: list, config: BootstrapConfig, gate: Gate) -> bool:
    try:
        into.append(BootstrapServer(config, gate))
        return True
    except ConfigError:
        return False
