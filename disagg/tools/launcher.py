"""Start disagg processes and wait for their ready line; stop them all, whatever happens.

The processes share one deployment key: DISAGG_AUTH_KEY from the environment, or (where the
environment names none and does not ask for DISAGG_INSECURE=1) a new key in a private temporary
folder that lives as long as the launcher."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque

from disagg.control.auth import AuthKey
from disagg.errors import DisaggError


class Launcher:
    def __init__(self, start_timeout_s: float = 120.0):
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self._drains: dict[int, threading.Thread] = {}   # pid -> the thread keeping its last log lines
        self._keys: tempfile.TemporaryDirectory | None = None
        self.auth_env: dict[str, str] = {}
        if not os.environ.get("DISAGG_AUTH_KEY") and os.environ.get("DISAGG_INSECURE") != "1":
            self._keys = tempfile.TemporaryDirectory(prefix="disagg-keys-")
            AuthKey.generate(os.path.join(self._keys.name, "deployment.key"))
            self.auth_env = {"DISAGG_AUTH_KEY": os.path.join(self._keys.name, "deployment.key")}

    def start(self, *args: str, prefix: tuple[str, ...] = ()) -> dict:
        """Run `[PREFIX...] python -m disagg ARGS` (a prefix such as `ip netns exec NS`); return
        the JSON line it prints once ready."""
        env = dict(os.environ, **self.auth_env, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"),
                   GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "2"))
        quiet = os.environ.get("DISAGG_QUIET", "1") == "1"   # 0: the children's logs go to our stderr
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "disagg", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if quiet else None, text=True, env=env)
        self.procs.append(proc)
        tail: deque[str] = deque(maxlen=3)   # its last log lines, to explain a failed start
        drain = threading.Thread(target=tail.extend, args=(proc.stderr,), daemon=True) if quiet else None
        if drain is not None:
            drain.start()
            self._drains[proc.pid] = drain
        ready, _, _ = select.select([proc.stdout], [], [], self.start_timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:   # its stdout ended (it exits) or it took too long (it is stopped)
            if not ready:
                proc.kill()
            code = proc.wait()
            state = f"exit code {code}" if ready else f"still starting after {self.start_timeout_s:g} s"
            if drain is not None:
                drain.join(5)   # it exited: its stderr ends
            said = (": " + " | ".join(l.strip() for l in tail)) if tail else ""
            raise DisaggError(f"`disagg {args[0]}` did not become ready ({state}){said}")
        return json.loads(line)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            drain = self._drains.pop(proc.pid, None)
            if drain is not None:
                drain.join(5)    # it exited: its stderr has ended
            if proc.stderr is not None:
                proc.stderr.close()
        self.procs.clear()
        if self._keys is not None:
            self._keys.cleanup()
            self._keys = None

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
