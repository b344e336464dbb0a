"""The reaper: keeps driving writes nobody waits for any more until the transport lets go of
them.

A write abandoned because its peer was lost may still be inside the transport (Mooncake keeps
a frozen peer's tasks pending until the peer thaws or dies). Nobody waits for it, but its end
must still be collected: that is what returns the peer's in-flight budget, so a peer that
comes back is not starved by its own stale writes. One daemon thread per transport, started
with the first abandoned write, asleep (on a condition, not polling) while it has none.
"""

import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Reapable(Protocol):
    peer: str

    @property
    def ended(self) -> bool: ...

    def pump(self) -> None: ...


class Reaper:
    def __init__(self, interval_s: float = 0.01, name: str = "kv-reaper"):
        self.interval_s, self.name = interval_s, name
        self._pending: list[Reapable] = []
        self._wake = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, write: Reapable) -> None:
        with self._wake:
            if self._stopped:
                return
            self._pending.append(write)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._wake.notify()

    def __len__(self) -> int:
        """Writes still being driven."""
        with self._wake:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                pending = list(self._pending)
            ended = []
            for w in pending:
                try:
                    w.pump()
                except Exception:  # a transport error ends it as well as a landing would
                    log.debug("abandoned write to %s: pump failed", w.peer, exc_info=True)
                if w.ended:
                    ended.append(w)
            with self._wake:
                gone = {id(w) for w in ended}
                self._pending = [w for w in self._pending if id(w) not in gone]
                if ended:
                    log.info(
                        "%d abandoned write(s) to %s ended; %d still in flight",
                        len(ended),
                        ended[0].peer,
                        len(self._pending),
                    )
                self._wake.wait(self.interval_s)

    def stop(self) -> None:
        """Stop driving (the transport is closing: its engine ends every task anyway)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
