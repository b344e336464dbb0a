"""Who may talk to the control plane's ZMQ sockets: ZMQ's CURVE security (every connection
authenticated and encrypted) with one key per deployment.

    AuthKey   the deployment's key pair, loaded from a file (`disagg keygen FILE` writes one;
              on Kubernetes a Secret mounted as a file), or none: insecure, an explicit choice
    Gate      one per ZMQ context: configures each socket as a CURVE server or client, runs
              the ZAP handler that admits only clients holding the deployment's key, and
              logs every failed handshake (a wrong key, no key, or not CURVE) on our side

    decode DEALER ---CURVE(client key = K, server key = K.public)---> prefill ROUTER
    REQ (decode, prefill) --------------same------------------------> bootstrap REP
                                                      ZAP: client key == K.public or refused

Servers and clients hold the same pair K: a peer that has it belongs to the deployment. One
without it cannot finish the handshake, so not one of its bytes reaches a decoder: no
registration, no lookup, no transfer request. The data ports of the transports are not
covered (Mooncake's TCP/RDMA engine has no authentication; CUDA IPC is same-host only):
docs/security.md says what that leaves open.
"""

import hmac
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from disagg.errors import ConfigError

log = logging.getLogger(__name__)

FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (not CURVE, or a different key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused: the key is not this deployment's",
}
REPEAT_LOG_S = 10.0  # a flood of failed handshakes logs once per socket and kind this often


@dataclass(frozen=True)
class AuthKey:
    public: bytes | None = None  # Z85, 40 bytes; None: insecure
    secret: bytes | None = None

    @property
    def secure(self) -> bool:
        return self.public is not None

    @staticmethod
    def load(path: str) -> "AuthKey":
        """A key file written by `disagg keygen` (a ZMQ certificate with its secret key)."""
        if not os.path.isfile(path):
            raise ConfigError(f"auth key {path!r}: No such file (create one with `disagg keygen {path}`)")
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"auth key {path!r}: {exc}") from None
        if secret is None:
            raise ConfigError(f"auth key {path!r} holds no secret key (give the file `disagg keygen` wrote)")
        mode = os.stat(path).st_mode
        if mode & 0o004:  # (group-readable is how Kubernetes mounts a Secret for the pod's fsGroup)
            log.warning(
                "auth key %s is readable by every user of this machine (mode %o): anyone who reads it "
                "can join the deployment; chmod 600 %s",
                path,
                mode & 0o777,
                path,
            )
        return AuthKey(public, secret)

    @staticmethod
    def generate(path: str) -> "AuthKey":
        """Write a new key pair to `path`, readable by its owner only."""
        public, secret = zmq.curve_keypair()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                "#   disagg deployment key (CURVE): keep it secret\nmetadata\ncurve\n"
                f'    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n'
            )
        return AuthKey(public, secret)


class Gate:
    def __init__(self, ctx: zmq.Context, key: AuthKey, process: str = "this process"):
        self.ctx, self.key = ctx, key
        self._zap: ThreadAuthenticator | None = None
        self._watch = _HandshakeWatch(ctx) if key.secure else None
        if key.secure:
            self._zap = ThreadAuthenticator(ctx, log=logging.getLogger("disagg.control.zap"))
            self._zap.start()
            self._zap.configure_curve_callback("*", credentials_provider=self)
        else:
            log.warning(
                "%s runs its control plane WITHOUT authentication (--insecure): anyone who reaches its "
                "ports can register, look up and request transfers; for local development only",
                process,
            )

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit a CURVE client only if it holds the deployment's key."""
        ok = hmac.compare_digest(client_key, self.key.public)  # pyzmq hands the key Z85-encoded
        if not ok and self._watch is not None:
            self._watch.note("ZAP", "refused a CURVE client whose key is not this deployment's")
        return ok

    def server(self, sock: zmq.Socket, name: str) -> zmq.Socket:
        """Before bind: `sock` admits only clients with the deployment's key."""
        if self.key.secure:
            sock.curve_secretkey, sock.curve_publickey = self.key.secret, self.key.public
            sock.curve_server = True
            self._watch.add(sock, name)
        return sock

    def client(self, sock: zmq.Socket, name: str) -> zmq.Socket:
        """Before connect: `sock` proves the deployment's key and talks only to a server with it."""
        if self.key.secure:
            sock.curve_secretkey, sock.curve_publickey = self.key.secret, self.key.public
            sock.curve_serverkey = self.key.public
            self._watch.add(sock, name)
        return sock

    def threads(self) -> dict[str, bool]:
        if self._zap is None:
            return {}
        return {"ZAP handler": self._zap.is_alive(), "handshake watch": self._watch._thread.is_alive()}

    def close(self) -> None:
        if self._zap is not None:
            self._zap.stop()
        if self._watch is not None:
            self._watch.stop()


class _HandshakeWatch:
    """A thread reading the monitor sockets of the watched sockets; it logs failed handshakes,
    at most once per REPEAT_LOG_S per (socket, kind), with how many there were."""

    def __init__(self, ctx: zmq.Context):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._new: list[tuple[zmq.Socket, str]] = []
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zmq-handshakes", daemon=True)
        self._thread.start()

    def add(self, sock: zmq.Socket, name: str) -> None:
        # our own address per monitor: pyzmq's default names it after the socket's file
        # descriptor, which a new socket may reuse before the closed one's monitor let go of it
        # ("Address already in use")
        addr = f"inproc://disagg-handshakes-{next(self._ids)}"
        sock.monitor(
            addr,
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_MONITOR_STOPPED,
        )
        monitor = sock.context.socket(zmq.PAIR)
        monitor.connect(addr)
        with self._lock:  # handed to the watch thread: it alone uses the monitor socket from now on
            self._new.append((monitor, name))

    def note(self, name: str, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, count = self._last.get((name, what), (float("-inf"), 0))
            if now - last < REPEAT_LOG_S:
                self._last[(name, what)] = (last, count + 1)
                return
            self._last[(name, what)] = (now, 0)
        log.warning("%s: %s%s", name, what, f" ({count} more since the last report)" if count else "")

    def _run(self) -> None:
        poller, names = zmq.Poller(), {}
        while not self._stop.is_set():
            with self._lock:
                new, self._new = self._new, []
            for monitor, name in new:
                poller.register(monitor, zmq.POLLIN)
                names[monitor] = name
            if not names:  # zmq polls nothing without waiting
                self._stop.wait(0.1)
                continue
            for monitor, _ in poller.poll(100):
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # the watched socket closed
                    poller.unregister(monitor)
                    monitor.close(linger=0)
                    del names[monitor]
                else:
                    peer = event.get("endpoint", b"").decode(errors="replace")
                    self.note(names[monitor], f"{FAILURES[event['event']]} with {peer}")
        with self._lock:
            new, self._new = self._new, []
        for monitor in [*names, *(m for m, _ in new)]:  # a context cannot end with one open
            monitor.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def key_from(path: str | None, insecure: bool) -> AuthKey:
    """The flags' choice: a key file, or --insecure, never neither (a clear error then)."""
    if path and insecure:
        raise ConfigError("give --auth-key or --insecure, not both")
    if path:
        return AuthKey.load(str(Path(path).expanduser()))
    if insecure:
        return AuthKey()
    raise ConfigError(
        "the control plane needs a key: --auth-key FILE (env DISAGG_AUTH_KEY; create one with "
        "`disagg keygen FILE` and give every process of the deployment the same file), or "
        "--insecure (env DISAGG_INSECURE=1) to run without authentication on a development machine"
    )


def add_auth_flags(p) -> None:
    # one of the two: the command line's choice beats the environment's (--insecure given by
    # hand wins over a DISAGG_AUTH_KEY exported earlier), which beats the file's (disagg/config.py)
    g = p.add_argument_group("authentication").add_mutually_exclusive_group()
    g.add_argument(
        "--auth-key",
        default=None,
        metavar="FILE",
        help="the deployment's CURVE key file, the same for every process (`disagg keygen FILE` writes one)",
    )
    g.add_argument("--insecure", action="store_true", help="no authentication on the control plane: development only")


def key_of(args) -> AuthKey:
    return key_from(args.auth_key, args.insecure)
