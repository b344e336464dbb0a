"""/health tells the truth: a process whose control loop died answers 503 "unhealthy" naming
the thread (an orchestrator restarts it) instead of serving half-alive; a second live prefill
of a rank is refused at start with a clear error."""

import json
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.errors import ConfigError
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings

POOL = PoolSettings(preset="tiny-full", max_tokens=1024, max_requests=2, device="cpu")


def _health(api: ApiServer) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the loop dies on purpose
def test_a_dead_control_loop_makes_the_process_unhealthy(eventually):
    prefill = PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind="tcp://127.0.0.1:*"))
    api = ApiServer(("127.0.0.1", 0), Service({}, lambda: True, CollectorRegistry(), health=prefill.health)).start()
    try:
        status, health = _health(api)
        assert status == 200 and health["status"] == "ok" and health["role"] == "prefill", health
        assert health["preset"] == "tiny-full" and health["auth"] == "insecure" and health["transports"]

        def broken(timeout_ms):   # what a ZMQ error inside the loop's socket does
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
