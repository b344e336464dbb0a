"""What every long-running disagg process does around its main loop."""

import logging
import signal
import threading


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT (Kubernetes stops pods with SIGTERM)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
