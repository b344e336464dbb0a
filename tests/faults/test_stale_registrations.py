"""Stale registrations through real processes (issue 35, items 5 and 6): an external
bootstrap; a prefill killed with SIGKILL, and a decode that must serve its replacement
without a restart; a bootstrap killed and restarted, and a newcomer that must not take the
live prefill's rank."""

import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from disagg.bootstrap.server import BootstrapClient
from disagg.control.messages import PROTOCOL_VERSION, LayoutInfo, RegisterPrefill
from disagg.errors import ProtocolError
from disagg.tools.launcher import Launcher
from fault_stack import requests, start_router
from transfer.buffers import Buffer

pytestmark = pytest.mark.slow

COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "8192", "--max-requests", "8"]
QUICK = ["--dead-after", "2", "--bootstrap-timeout", "2", "--waiting-timeout", "4"]
_room = iter(range(1000, 10**6))
LAYOUT = LayoutInfo(16, "page_major", [Buffer(0, 4096 * 8, 4096, "full", None, None)])


def _decode_alone(decode: dict) -> dict:
    """A /decode with no prompt sent to prefill: it fails, and how far it got says what decode
    did (no bootstrap_ms: it failed looking the prefill up or registering with it)."""
    body = json.dumps({"room": next(_room), "token_ids": [1, 2, 3]}).encode()
    req = urllib.request.Request(decode["http"] + "/decode", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def _kill(launcher: Launcher, ready: dict) -> None:
    proc = next(p for p in launcher.procs if p.pid == ready["pid"])
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _serves(launcher: Launcher, prefill: dict, decode: dict) -> None:
    router = start_router(launcher, prefill, decode)
    out = requests(router, [120, 300, 50])
    assert all(r["ok"] and r["verified"] for r in out), [r.get("reason") for r in out]


def test_decode_serves_a_restarted_prefill_after_a_failed_registration(eventually):
    """Issue 35, item 5: after the old prefill's lease lapsed, lookups still named it; decode
    registered there, got no answer, and kept that lookup: every request failed with "did not
    answer the registration in time" while the bootstrap named the new prefill, until decode
    was restarted. Now a lapsed lease is never handed out, and a failed registration drops
    the lookup: the first request after the restart is served."""
    with Launcher() as launcher:
        boot = launcher.start("bootstrap", "--bootstrap-bind", "tcp://127.0.0.1:*")["bootstrap"]
        prefill = launcher.start("prefill", *COMMON, *QUICK, "--bootstrap-bind", "none", "--bootstrap-addr", boot)
        decode = launcher.start("decode", *COMMON, *QUICK, "--bootstrap-addr", boot)
        _serves(launcher, prefill, decode)
        _kill(launcher, prefill)
        # past --dead-after: decode dropped the dead peer and fails where it looks it up again
        eventually(lambda: "bootstrap_ms" not in _decode_alone(decode), 30, "decode forgot the dead prefill")
        prefill2 = launcher.start("prefill", *COMMON, *QUICK, "--bootstrap-bind", "none", "--bootstrap-addr", boot)
        assert prefill2["control"] != prefill["control"]
        _serves(launcher, prefill2, decode)


def test_a_registration_that_was_never_answered_is_not_kept(eventually):
    """The same within the dead prefill's lease: the bootstrap still names it (it may only be
    slow), decode registers, no answer comes. That lookup and peer must not be kept either."""
    with Launcher() as launcher:
        boot = launcher.start("bootstrap", "--bootstrap-bind", "tcp://127.0.0.1:*")["bootstrap"]
        prefill = launcher.start("prefill", *COMMON, *QUICK, "--bootstrap-bind", "none", "--bootstrap-addr", boot)
        decode = launcher.start("decode", *COMMON, *QUICK, "--bootstrap-addr", boot)  # registered at start
        _kill(launcher, prefill)
        failed = _decode_alone(decode)  # its prefill is gone: within the lease, the bootstrap still names it
        assert failed["state"] == "FAILED", failed
        # decode's readiness watch drops the silent peer, looks the rank up (the lapsing lease), registers
        # and gets no answer: neither that lookup nor that peer may be kept
        eventually(lambda: _get(decode["http"] + "/ready")["ready"] is False, 30, "decode unready without prefill")
        prefill2 = launcher.start("prefill", *COMMON, *QUICK, "--bootstrap-bind", "none", "--bootstrap-addr", boot)
        _serves(launcher, prefill2, decode)


def test_a_restarted_bootstrap_gives_the_live_prefill_its_rank_back(keyed, eventually):
    """Issue 35, item 6: right after a bootstrap restart a key holder took rank 0 on its first
    try, before the live prefill renewed. The restarted bootstrap keeps each rank for its live
    holder for a grace period: the newcomer is refused and the live prefill re-claims."""
    with Launcher() as launcher:
        boot = launcher.start("bootstrap", "--bootstrap-bind", "tcp://127.0.0.1:*")
        prefill = launcher.start("prefill", *COMMON, "--bootstrap-bind", "none", "--bootstrap-addr", boot["bootstrap"])
        decode = launcher.start("decode", *COMMON, "--bootstrap-addr", boot["bootstrap"])
        _kill(launcher, boot)
        launcher.start("bootstrap", "--bootstrap-bind", boot["bootstrap"])
        client = BootstrapClient(boot["bootstrap"], keyed, timeout_s=10)
        newcomer = RegisterPrefill(PROTOCOL_VERSION, 0, 1, "tcp://127.0.0.1:9", time.time_ns(), LAYOUT)
        try:
            with pytest.raises(ProtocolError, match="kept for its live holder|held by a live prefill"):
                client.register(newcomer)
            eventually(lambda: _named(client) == prefill["control"], 15, "the live prefill re-claimed rank 0")
            with pytest.raises(ProtocolError, match="held by a live prefill"):
                client.register(newcomer)
        finally:
            client.close()
        assert _get(prefill["http"] + "/ready")["ready"] is True
        _serves(launcher, prefill, decode)


def _named(client: BootstrapClient) -> str | None:
    try:
        return client.lookup(PROTOCOL_VERSION, 0).control_endpoint
    except ProtocolError:
        return None


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
