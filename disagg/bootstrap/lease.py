"""A prefill rank's hold on its bootstrap entry: take it at start (waiting out the lease of a
predecessor that just died, refusing to start next to a live one), then renew it every
RENEW_S from a thread of its own (which owns its REQ socket). Renewals also put the entry
back into a bootstrap that restarted and lost it.

    start:  register --refused, LIVE_HOLDER--> retry until the holder's lease could have run
            out (lease_s + RENEW_S) --still held--> ConfigError: a second live instance
    then:   every RENEW_S register again (same message); failures are logged, never fatal
"""

import logging
import threading
import time

from disagg.bootstrap.server import LIVE_HOLDER, BootstrapClient
from disagg.control.auth import Gate
from disagg.control.messages import RegisterPrefill
from disagg.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

RENEW_S = 1.0
LEASE_S = 3.0   # what BootstrapConfig.lease_s defaults to: how long a predecessor may hold on


class BootstrapLease:
    def __init__(self, gate: Gate, endpoint: str, info: RegisterPrefill, renew_s: float = RENEW_S):
        self.gate, self.endpoint, self.info, self.renew_s = gate, endpoint, info, renew_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="bootstrap-lease", daemon=True)

    def acquire(self, wait_s: float = LEASE_S + RENEW_S) -> None:
        """Register; raise ConfigError if a live instance holds the rank after wait_s, and
        ProtocolError if the bootstrap refuses for any other reason or does not answer."""
        client = BootstrapClient(self.endpoint, self.gate)
        give_up = time.monotonic() + wait_s
        try:
            while True:
                try:
                    client.register(self.info)
                    break
                except ProtocolError as exc:
                    if LIVE_HOLDER not in str(exc):
                        raise
                    if time.monotonic() >= give_up:
                        raise ConfigError(f"{exc} (still so after {wait_s:g} s)") from None
                    self._stop.wait(self.renew_s / 4)
        finally:
            client.close()
        self._thread.start()

    def _renew(self) -> None:
        client = BootstrapClient(self.endpoint, self.gate, timeout_s=max(self.renew_s, 1.0))
        failing = False
        try:
            while not self._stop.wait(self.renew_s):
                try:
                    client.register(self.info)
                    if failing:
                        log.info("bootstrap %s: registration renewed again", self.endpoint)
                    failing = False
                except ProtocolError as exc:
                    if not failing:
                        log.warning("bootstrap %s: renewing rank %d failed: %s", self.endpoint, self.info.tp_rank,
                                    exc)
                    failing = True
        finally:
            client.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
