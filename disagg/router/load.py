"""LoadBook: what the router believes of each worker rank's load, in prompt tokens queued and
running there, for `--route kv` (disagg/router/scoring.py) and its /metrics.

    believed(rank) = this router's requests there now          counted from sent to answered
                   + what the rank's last report held beyond   its /health's `load`, read by the
                     this router's requests there then          monitor each round (probe_every_s):
                                                                the other routers' requests

Why both: a deployment runs several routers in front of the same workers, and a router knows
its own requests exactly but no other's; a report holds every router's, but is up to a round
old. Read alone, it would miss a burst this router sent since (those count at once here) and
keep counting a request of this router that ended since (the next turn of a conversation
would leave the pages it just cached for a stale figure). So the router takes from a report
only what was not its own when it was read, and adds its own as they are now: never less than
its own, never less than the report unless a request of its own there ended since, and no
request counted twice. Its own count runs from before a request is sent to after it is
answered, and the part of a report that is its own is taken as all it had there at any time
while the report was asked (`asking`): what the report holds beyond that is never this
router's. An instance's load is its busiest rank's.

Every report is untrusted (disagg/control/load.py): a /health without a well-formed `load`
(an older worker, one unreachable, one that lies badly) leaves that rank's report unknown,
logged at WARNING once until it answers well again (a missing section quietly), and the
router counts only its own requests there; a number over its cap is read as the cap.
"""

import logging
import threading
from collections.abc import Iterable

from disagg.control.load import LoadError, WorkerLoad, read_load

log = logging.getLogger(__name__)


def believed(reported: "WorkerLoad | None", own_then: int, own_now: int) -> int:
    """A rank's load in tokens: our requests there now, and what its report (None: unknown)
    held beyond the `own_then` tokens of ours there when it was read."""
    others = max(0, reported.tokens - own_then) if reported is not None else 0
    return others + own_now


class LoadBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._own: dict[str, int] = {}  # rank URL -> prompt tokens of our requests in flight there
        self._reported: dict[str, WorkerLoad | None] = {}  # rank URL -> its last report (None: unknown)
        self._then: dict[str, int] = {}  # rank URL -> our tokens there when its last report was read
        self._asking: dict[str, int] = {}  # rank URL -> our tokens there from asking its report on
        self._refused: set[str] = set()  # ranks whose last report was refused (logged once)

    def sent(self, urls: Iterable[str], tokens: int) -> None:
        """A request of `tokens` went to these ranks (negative: it was answered)."""
        with self._lock:
            for url in urls:
                if tokens > 0 and url in self._asking:
                    self._asking[url] += tokens
                left = self._own.get(url, 0) + tokens
                if left:
                    self._own[url] = left
                else:
                    self._own.pop(url, None)

    def asking(self, urls: Iterable[str]) -> None:
        """The monitor is about to ask these ranks for their /health: the report may hold any
        request of ours there from now until it is read (those there now, and those sent
        meanwhile), which is what it holds of ours at most."""
        with self._lock:
            self._asking.update({url: self._own.get(url, 0) for url in urls})

    def report(self, url: str, health: dict) -> None:
        """A rank's /health as the monitor just read it ({} when it did not answer)."""
        load, why = None, None
        if "load" in health:
            try:
                load = read_load(health["load"])
            except LoadError as exc:
                why = str(exc)
        with self._lock:
            self._reported[url] = load
            self._then[url] = self._asking.pop(url, self._own.get(url, 0))
            first = why is not None and url not in self._refused
            if why is None:
                self._refused.discard(url)
            else:
                self._refused.add(url)
        if first:
            log.warning("%s: %s; counting only this router's requests there until it answers well", url, why)

    def forget(self, urls: Iterable[str]) -> None:
        """Ranks no pair names any more."""
        with self._lock:
            for url in urls:
                self._reported.pop(url, None)
                self._then.pop(url, None)
                self._asking.pop(url, None)
                self._refused.discard(url)

    def tokens(self, urls: Iterable[str]) -> int:
        """An instance's load (its ranks' URLs): its busiest rank's."""
        with self._lock:
            return max((self._believed(u) for u in urls), default=0)

    def reported(self, url: str) -> "WorkerLoad | None":
        """A rank's last report, capped (None: unknown)."""
        with self._lock:
            return self._reported.get(url)

    def ranks(self) -> dict[str, int]:
        """Every rank known (reported on, or with our requests) -> its load in tokens."""
        with self._lock:
            return {u: self._believed(u) for u in {*self._reported, *self._own}}

    def _believed(self, url: str) -> int:  # (under the lock)
        return believed(self._reported.get(url), self._then.get(url, 0), self._own.get(url, 0))
