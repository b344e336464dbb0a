"""What every long-running disagg process does around its main loop."""

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from disagg.checks import positive_int

log = logging.getLogger("disagg")

LEVELS = ("debug", "info", "warning", "error")


def add_process_flags(p: argparse.ArgumentParser, torch_threads: bool = False) -> None:
    """The "process" group: --log-level (and --torch-threads for the workers)."""
    g = p.add_argument_group("process")
    if torch_threads:
        g.add_argument(
            "--torch-threads",
            type=positive_int,
            default=1,
            help="torch intra-op threads (1 leaves cores to the transport's own threads)",
        )
    g.add_argument(
        "--log-level",
        default="info",
        choices=LEVELS,
        help="debug also shows Mooncake's start-up lines (RDMA probing, segment set-up), kept out of the log at info",
    )


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(name)s %(levelname)s %(message)s")


SLOW_STOP_S = 3.0  # a step of stopping that takes longer says what it waits for


def freeze_heap() -> int:
    """Once a process has built what it keeps (modules, pools, engines), take those objects out
    of the garbage collector's passes: gc.freeze(). A worker holds ~180k tracked objects after
    start-up (torch and its operators, most of them) and a full collection visits them all:
    64-68 ms on an idle core, ~120 ms under load, holding the GIL, so it stalls whichever
    transfer it lands in (issue 40's profile caught it in the senders). Objects made later are
    still collected. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve_api(api, readiness: Callable[[], dict], on_ready: Callable[[], None], close: Callable[[], None]) -> None:
    """Start `api` (an ApiServer), serve until SIGTERM or SIGINT (see serve), then stop it
    and `close` the role's server (its peers, transfers, pool). The heap built so far is
    frozen first (freeze_heap)."""
    log.debug("froze %d objects out of the collector's passes", freeze_heap())
    api.start()
    try:
        serve(readiness, on_ready)
    finally:
        with _slow("the HTTP server (requests still being answered)"):
            api.stop()
        with _slow("peers, transfers and the pool to close"):
            close()


@contextmanager
def _slow(what: str):
    timer = threading.Timer(
        SLOW_STOP_S,
        lambda: os.write(2, f"disagg: still stopping: waiting for {what} (Ctrl-C again to exit at once)\n".encode()),
    )
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call `stop` on SIGTERM (what Kubernetes and `kill` send) and on SIGINT (Ctrl-C), after
    saying at once that the process stops; a second signal while it stops exits at once.
    Setting a handler also undoes a SIGINT that the launching shell ignored (a background job
    of a script, `nohup ... &`), so Ctrl-C and `kill -INT` stop the process wherever it
    started. `stop` runs in the main thread between two bytecodes: it must only set a flag."""
    stopping = threading.Event()

    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if stopping.is_set():
            os.write(2, f"disagg: {name} again: exiting at once\n".encode())
            os._exit(130)
        stopping.set()
        os.write(2, f"disagg: {name}: stopping ...\n".encode())  # (os.write: no logging lock in a handler)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def serve(readiness: Callable[[], dict], on_ready: Callable[[], None], warn_every_s: float = 10.0) -> None:
    """Block until SIGTERM or SIGINT (Kubernetes stops pods with SIGTERM). Once `readiness()`
    says ready (as /ready does), call `on_ready` (the ready lines) once; until then log why
    not, at WARNING, every `warn_every_s`."""
    stop = threading.Event()
    stop_on_signals(stop.set)
    warned = -warn_every_s
    while not stop.is_set():
        state = readiness()
        if state["ready"]:
            on_ready()
            break
        if time.monotonic() - warned >= warn_every_s:
            log.warning("not ready: %s", state.get("why", "unknown"))
            warned = time.monotonic()
        stop.wait(0.25)
    stop.wait()


def exit_now(code: int) -> None:
    """End a server process once it has closed what it holds: flush, then exit without the
    interpreter's teardown (collecting a worker's objects at exit took 4-24 s, silently)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
