"""Start disagg processes and wait for their ready line; stop them all, whatever happens:
on leaving the `with` block, on an error, on Ctrl-C, and on SIGTERM to the launching process
(which the launcher turns into KeyboardInterrupt while it runs, so `kill PID` of a demo does not
leave its workers behind).

The processes share one deployment key: DISAGG_AUTH_KEY from the environment, or (where the
environment names none and does not ask for DISAGG_INSECURE=1) a new key in a private temporary
folder that lives as long as the launcher. Every other DISAGG_<FLAG> variable is kept from them:
a child's settings are the flags it is started with."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

from disagg.control.auth import AuthKey
from disagg.errors import DisaggError


PASSED = ("DISAGG_AUTH_KEY", "DISAGG_INSECURE")  # DISAGG_ variables the children see (DISAGG_TEST_* too)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Launcher:
    def __init__(self, start_timeout_s: float = 120.0, logs: bool = False):
        """logs: the children's logs go to our stderr (else kept, last lines shown if one fails)."""
        self.start_timeout_s = start_timeout_s
        self.logs = logs
        self._old_sigterm = None
        self.procs: list[subprocess.Popen] = []
        self._drains: dict[int, threading.Thread] = {}  # pid -> the thread keeping its last log lines
        self._keys: tempfile.TemporaryDirectory | None = None
        self.auth_env: dict[str, str] = {}
        if not os.environ.get("DISAGG_AUTH_KEY") and os.environ.get("DISAGG_INSECURE") != "1":
            self._keys = tempfile.TemporaryDirectory(prefix="disagg-keys-")
            AuthKey.generate(os.path.join(self._keys.name, "deployment.key"))
            self.auth_env = {"DISAGG_AUTH_KEY": os.path.join(self._keys.name, "deployment.key")}

    def start(self, *args: str, prefix: tuple[str, ...] = ()) -> dict:
        """Run `[PREFIX...] python -m disagg ARGS` (a prefix such as `ip netns exec NS`); return
        the JSON line it prints once ready."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("DISAGG_") or k in PASSED or k.startswith("DISAGG_TEST_")
        }
        env.update(self.auth_env)
        quiet = not self.logs
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "disagg", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if quiet else None,
            text=True,
            env=env,
        )
        self.procs.append(proc)
        tail: deque[str] = deque(maxlen=3)  # its last log lines, to explain a failed start
        drain = threading.Thread(target=tail.extend, args=(proc.stderr,), daemon=True) if quiet else None
        if drain is not None:
            drain.start()
            self._drains[proc.pid] = drain
        ready, _, _ = select.select([proc.stdout], [], [], self.start_timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:  # its stdout ended (it exits) or it took too long (it is stopped)
            if not ready:
                proc.kill()
            code = proc.wait()
            state = f"exit code {code}" if ready else f"still starting after {self.start_timeout_s:g} s"
            if drain is not None:
                drain.join(5)  # it exited: its stderr ends
            said = (": " + " | ".join(l.strip() for l in tail)) if tail else ""
            raise DisaggError(f"`disagg {args[0]}` did not become ready ({state}){said}")
        ready_line = json.loads(line)
        ready_line["started_s"] = round(time.perf_counter() - t0, 2)
        ready_line["pid"] = proc.pid
        return ready_line

    def start_instance(self, role: str, tp_size: int, *args: str, prefix: tuple[str, ...] = ()) -> list[dict]:
        """The TP ranks 0 .. tp_size - 1 of one instance of `role`, each `disagg ROLE ARGS
        --tp-size N --tp-rank R`; prefill ranks after the first register with rank 0's
        bootstrap (which runs where ARGS say). Returns their ready lines in rank order."""
        ranks: list[dict] = []
        for rank in range(tp_size):
            more = ["--tp-size", str(tp_size), "--tp-rank", str(rank)]
            if role == "prefill" and rank:
                more += ["--bootstrap-bind", "none", "--bootstrap-addr", ranks[0]["bootstrap"]]
            ranks.append(self.start(role, *args, *more, prefix=prefix))
        return ranks

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
                drain.join(5)  # it exited: its stderr has ended
            if proc.stderr is not None:
                proc.stderr.close()
        self.procs.clear()
        if self._keys is not None:
            self._keys.cleanup()
            self._keys = None

    def __enter__(self) -> "Launcher":
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
