"""Processes a test starts, ended whatever happens: each in a process group of its own (so what
it starts goes too, and a Ctrl-C meant for pytest reaches it only through us), asked to stop
with a signal, then killed with its whole group if it has not within the bound."""

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator


def spawn(cmd: list[str], **popen) -> subprocess.Popen:
    """Popen in a new session (process group); end it with `reap`."""
    return subprocess.Popen(cmd, start_new_session=True, **popen)


def reap(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30.0) -> int:
    """Send `sig` to the process (if it still runs), wait up to wait_s, then SIGKILL whatever
    is left of its group; close its pipes. Returns its exit code."""
    try:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # it, if it hung, and anything it left behind
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    return proc.returncode


@contextlib.contextmanager
def running(cmd: list[str], sig: int = signal.SIGTERM, wait_s: float = 30.0, **popen) -> Iterator[subprocess.Popen]:
    """`with running([...]) as proc:` the process, reaped on leaving the block however it ends."""
    proc = spawn(cmd, **popen)
    try:
        yield proc
    finally:
        reap(proc, sig, wait_s)
