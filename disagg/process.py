"""What every long-running disagg process does around its main loop."""

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable

from disagg.worker.checks import positive_int

log = logging.getLogger("disagg")

LEVELS = ("debug", "info", "warning", "error")


def add_process_flags(p: argparse.ArgumentParser, torch_threads: bool = False) -> None:
    """The "process" group: --log-level (and --torch-threads for the workers)."""
    g = p.add_argument_group("process")
    if torch_threads:
        g.add_argument("--torch-threads", type=positive_int, default=1,
                       help="torch intra-op threads (1 leaves cores to the transport's own threads)")
    g.add_argument("--log-level", default="info", choices=LEVELS,
                   help="debug also shows Mooncake's start-up lines (RDMA probing, segment set-up), kept out of "
                        "the log at info")


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Call `stop` on SIGTERM (what Kubernetes and `kill` send) and on SIGINT (Ctrl-C). Setting
    a handler also undoes a SIGINT that the launching shell ignored (a background job of a
    script, `nohup ... &`), so Ctrl-C and `kill -INT` stop the process wherever it started.
    `stop` runs in the main thread between two bytecodes: it must only set a flag."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())


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
