"""A prefill rank's hold on its bootstrap entry: take it at start (waiting out the lease of a
predecessor that just died, or the grace period of a bootstrap that just started; refusing
to start next to a live one), then renew it every RENEW_S from a thread of its own (which owns
its REQ socket). Renewals also re-claim the rank from a bootstrap that restarted and lost it.

    start:  register --refused, LIVE_HOLDER--> retry until the holder's lease could have run
            out --still held--> ConfigError: a second live instance
                     --refused, RECLAIMING--> retry until the bootstrap's grace period ended
    then:   every RENEW_S renew:
              answered yes              -> HELD
              no answer                 -> UNREACHABLE (warning once; decode that knows us
                                           keeps being served; new decode cannot find anyone)
              refused (another endpoint holds the rank, our epoch is older, ...)
                                        -> LOST: an ERROR now and every LOST_REPEAT_S, and
                                           /ready false with the reason (decode is sent to
                                           the other holder; only a restart takes it back
                                           from a newer epoch)
"""

import enum
import logging
import threading
import time

from disagg.bootstrap.server import (
    LEASE_S,
    LIVE_HOLDER,
    RECLAIMING,
    RENEW_S,
    BootstrapClient,
    NoAnswer,
    Refusal,
)
from disagg.control.auth import Gate
from disagg.control.messages import RegisterPrefill
from disagg.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

LOST_REPEAT_S = 30.0  # a lost rank is logged again this often while it stays lost
FIRST_TRY_S = 0.5  # acquire with reach_s: the first try's wait for an answer (then doubled)
ANSWER_S = 5.0  # ... up to this (the client's usual timeout)


class Hold(enum.Enum):
    HELD = "held"
    UNREACHABLE = "bootstrap unreachable"
    LOST = "lost"


class BootstrapLease:
    def __init__(self, gate: Gate, endpoint: str, info: RegisterPrefill, renew_s: float = RENEW_S):
        self.gate, self.endpoint, self.info, self.renew_s = gate, endpoint, info, renew_s
        self.state: tuple[Hold, str] = (Hold.HELD, "")  # and why not; written by the renewing thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="bootstrap-lease", daemon=True)

    def acquire(self, wait_s: float = LEASE_S + RENEW_S, *, reach_s: float = 0.0) -> None:
        """Register; raise ConfigError if a live instance holds the rank after wait_s (counted
        from the end of a restarted bootstrap's grace period), and ProtocolError if the
        bootstrap refuses for any other reason or does not answer. `reach_s` > 0: a bootstrap
        that does not answer is asked again (each try waiting longer, up to the client's
        timeout) until reach_s after the start: the ranks of a TP instance start at once, and
        rank 0's bootstrap may come up later than its other ranks ask."""
        client = BootstrapClient(self.endpoint, self.gate)
        start = since = time.monotonic()  # wait_s counts from the last try the bootstrap left unanswered
        give_up = start + wait_s
        if reach_s > 0:
            client.timeout_s = min(FIRST_TRY_S, reach_s)
        try:
            while True:
                try:
                    client.register(self.info)
                    break
                except NoAnswer as exc:
                    self._unanswered(client, exc, start, reach_s)
                    since = time.monotonic()
                    give_up = since + wait_s
                except ProtocolError as exc:
                    if LIVE_HOLDER not in str(exc) and RECLAIMING not in str(exc):
                        raise
                    if RECLAIMING in str(exc):  # (bounded: a grace period is about wait_s)
                        give_up = min(max(give_up, time.monotonic() + wait_s), since + 3 * wait_s)
                    if time.monotonic() >= give_up:
                        raise ConfigError(f"{exc} (still so after {wait_s:g} s)") from None
                    self._stop.wait(self.renew_s / 4)
        finally:
            client.close()
        self._thread.start()

    def _unanswered(self, client: BootstrapClient, exc: NoAnswer, start: float, reach_s: float) -> None:
        """After a try the bootstrap did not answer: the next one waits twice as long (at most
        the client's usual timeout and what is left of reach_s); ProtocolError once reach_s passed."""
        waited, left = time.monotonic() - start, start + reach_s - time.monotonic()
        if left <= 0:
            if reach_s <= 0:
                raise exc
            raise ProtocolError(
                f"bootstrap {self.endpoint} did not answer rank {self.info.tp_rank} within {reach_s:g} s "
                f"of its start (is the instance's rank 0 running it there, with this deployment's auth key?)"
            ) from None
        log.warning(
            "bootstrap %s: no answer yet after %.1f s; rank %d asks again (up to %g s)",
            self.endpoint,
            waited,
            self.info.tp_rank,
            reach_s,
        )
        client.timeout_s = min(2 * client.timeout_s, ANSWER_S, left)

    def _renew(self) -> None:
        client = BootstrapClient(self.endpoint, self.gate, timeout_s=max(self.renew_s, 1.0))
        said = float("-inf")  # when the current trouble was last logged
        try:
            while not self._stop.wait(self.renew_s):
                try:
                    client.renew(self.info)
                    hold, why = Hold.HELD, ""
                except Refusal as exc:
                    hold, why = Hold.LOST, str(exc)
                except ProtocolError as exc:
                    hold, why = Hold.UNREACHABLE, str(exc)
                said = self._tell(hold, why, said)
                self.state = (hold, why)
        finally:
            client.close()

    def _tell(self, hold: Hold, why: str, said: float) -> float:
        """Log a change of hold (and a lost rank again every LOST_REPEAT_S); returns when the
        current trouble was last logged."""
        rank, now = self.info.tp_rank, time.monotonic()
        if hold is self.state[0] and (hold is not Hold.LOST or now - said < LOST_REPEAT_S):
            return said
        if hold is Hold.HELD:
            log.info("bootstrap %s: rank %d is ours again (renewed)", self.endpoint, rank)
        elif hold is Hold.UNREACHABLE:
            log.warning("bootstrap %s: renewing rank %d failed: %s", self.endpoint, rank, why)
        else:
            log.error(
                "bootstrap %s: rank %d is no longer this prefill's (%s): not ready; decode is sent to "
                "whoever holds it. Stop the other holder, or restart this prefill to take it back once "
                "that one stopped",
                self.endpoint,
                rank,
                why,
            )
        return now

    @property
    def lost(self) -> str | None:
        """Why the bootstrap no longer lists us as our rank's holder, or None."""
        hold, why = self.state
        return why if hold is Hold.LOST else None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
