"""The control plane's authentication over real ZMQ sockets: a peer without the deployment's
key gets nothing from a bootstrap or a control socket, both sides log why, and the key file
and flags refuse what cannot work with one clear line."""

import logging
import os
import stat
import subprocess
import sys

import pytest
import zmq

from disagg.bootstrap.server import BootstrapClient, BootstrapConfig, BootstrapServer
from disagg.control.auth import AuthKey, key_from
from disagg.control.messages import PROTOCOL_VERSION, LayoutInfo, RegisterPrefill, encoder
from disagg.errors import ConfigError, ProtocolError
from transfer.buffers import Buffer

LAYOUT = LayoutInfo(16, "page_major", [Buffer(0, 4096 * 8, 4096, "full", None, None)])


def _register(rank: int = 0) -> RegisterPrefill:
    return RegisterPrefill(PROTOCOL_VERSION, rank, 1, "tcp://127.0.0.1:7000", 1, LAYOUT)


@pytest.fixture()
def bootstrap(keyed):
    server = BootstrapServer(BootstrapConfig("tcp://127.0.0.1:*", grace_s=0), keyed).start()
    yield server
    server.stop()


def test_a_key_file_round_trips_and_is_private(tmp_path):
    path = str(tmp_path / "k")
    key = AuthKey.generate(path)
    assert AuthKey.load(path) == key and key.secure and len(key.public) == 40
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        AuthKey.generate(path)  # never overwritten


@pytest.mark.parametrize("content,match", [(None, "No such file"), ("not a certificate", "No public key")])
def test_a_bad_key_file_is_one_clear_error(tmp_path, content, match):
    path = tmp_path / "k"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        AuthKey.load(str(path))


def test_no_key_and_no_insecure_is_refused_with_what_would_work():
    with pytest.raises(ConfigError, match="--auth-key FILE.*disagg keygen.*--insecure"):
        key_from(None, False)
    assert not key_from(None, True).secure


def test_the_deployment_key_gets_answers(bootstrap, keyed):
    client = BootstrapClient(bootstrap.endpoint, keyed, timeout_s=10)
    client.register(_register())
    assert client.lookup(PROTOCOL_VERSION).control_endpoint == "tcp://127.0.0.1:7000"
    client.close()


def _said(caplog, *parts: str) -> bool:
    return any(all(p in r.getMessage() for p in parts) for r in caplog.records)


def test_a_wrong_key_gets_nothing_and_both_sides_say_why(bootstrap, stranger, caplog, eventually):
    caplog.set_level(logging.WARNING, "disagg.control.auth")
    client = BootstrapClient(bootstrap.endpoint, stranger, timeout_s=1)
    with pytest.raises(ProtocolError, match="auth key"):
        client.register(_register())
    client.close()
    assert bootstrap.ranks == {}
    eventually(lambda: _said(caplog, "bootstrap: handshake failed"), 10, "the server logs the failed handshake")
    eventually(lambda: _said(caplog, "bootstrap client of", "handshake failed"), 10, "the client logs it too")


def test_knowing_the_public_key_is_not_enough(bootstrap, keyed, stranger, caplog, eventually):
    """A client that expects the right server (the deployment's public key is no secret) but
    proves a key of its own: the ZAP handler refuses it, and the client hears why."""
    caplog.set_level(logging.WARNING, "disagg.control.auth")
    sock = stranger.ctx.socket(zmq.REQ)
    sock.curve_secretkey, sock.curve_publickey = stranger.key.secret, stranger.key.public
    sock.curve_serverkey = keyed.key.public
    sock.setsockopt(zmq.LINGER, 0)
    stranger._watch.add(sock, "impostor")
    sock.connect(bootstrap.endpoint)
    try:
        sock.send(encoder.encode(_register()))
        assert not sock.poll(1000), "an impostor was answered"
        assert bootstrap.ranks == {}
        eventually(lambda: _said(caplog, "ZAP", "not this deployment's"), 10, "the server logs the refused key")
        eventually(lambda: _said(caplog, "impostor: refused"), 10, "the impostor is told it was refused")
    finally:
        sock.close()


def test_a_peer_without_curve_gets_nothing(bootstrap, caplog, eventually):
    caplog.set_level(logging.WARNING, "disagg.control.auth")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(bootstrap.endpoint)
    try:
        sock.send(encoder.encode(_register()))
        assert not sock.poll(1000), "a plain-text peer was answered"
        sock.close()
        assert bootstrap.ranks == {}
        eventually(lambda: _said(caplog, "bootstrap: handshake failed"), 10, "the server logs the failed handshake")
    finally:
        sock.close()
        ctx.term()


def test_keygen_writes_a_key_the_processes_take(tmp_path):
    path = tmp_path / "deployment.key"
    out = subprocess.run([sys.executable, "-m", "disagg", "keygen", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "public key" in out.stdout and AuthKey.load(str(path)).secure
    again = subprocess.run([sys.executable, "-m", "disagg", "keygen", str(path)], capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr and "Traceback" not in again.stderr


def test_a_key_file_every_user_can_read_is_warned_about(tmp_path, caplog):
    """Issue 36: a world-readable key was accepted silently (ssh refuses one)."""
    import logging

    from disagg.control.auth import AuthKey

    path = tmp_path / "deployment.key"
    AuthKey.generate(str(path))
    with caplog.at_level(logging.WARNING, logger="disagg.control.auth"):
        AuthKey.load(str(path))
        assert not caplog.records  # 0600, as keygen writes it
        os.chmod(path, 0o640)
        AuthKey.load(str(path))
        assert not caplog.records  # group-readable: a Kubernetes Secret for the pod's fsGroup
        os.chmod(path, 0o644)
        AuthKey.load(str(path))
    assert (
        "readable by every user" in caplog.records[-1].getMessage() and "chmod 600" in caplog.records[-1].getMessage()
    )
