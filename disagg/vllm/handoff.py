"""Handoff: the one place vLLM's thread and a DisaggWorker's loop thread meet.

    vLLM's thread                        the loop thread (owns sockets and the request table)
    step(meta)      --post-->  inbox  --take-->  Send / Load / Release; internal events too
    finished()      <--------  done   <--------  sent(req_id), received(req_id, failed blocks)
    load_errors()   the failed blocks of the loads the last finished() reported
    failed_loads()  those loads' request ids (vLLM takes failures per request, not per block,
                    for models of several KV cache groups)
    figures()       how the sends and loads finished() reported went (disagg.vllm.stats), once

vLLM asks get_finished() and then get_block_ids_with_load_errors() in one step: a failed
load's blocks are handed over with its finished_recving, never a step later (the scheduler
would run the request on blocks it believes loaded). A transfer's figures come with its
finished_* report likewise: vLLM stops stepping an idle engine once nothing is unfinished, and
figures held back a step would wait for the next request.
"""

import queue
import threading

from disagg.vllm import stats
from disagg.vllm.stats import Ended


class Handoff:
    def __init__(self):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._sending: set[str] = set()
        self._recving: dict[str, tuple[int, ...]] = {}  # req_id -> its failed blocks (none: loaded)
        self._errors: set[int] = set()  # taken by the last finished()
        self._failed: set[str] = set()  # their requests
        self._figures = stats.empty()  # of the transfers not yet reported
        self._taken = stats.empty()  # of those the last finished() reported

    # ---- the loop thread's side ----------------------------------------------------------------
    def post(self, item) -> None:
        """Any thread: something for the loop (a StepMeta, or the loop's own event)."""
        self._inbox.put(item)

    def take(self) -> list:
        """What was posted since the last take (never blocks)."""
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def sent(self, req_id: str, ended: Ended | None = None) -> None:
        """A producer's blocks may be freed: sent, given up on, or never asked for in time
        (`ended`: how its send went, for the stats; None: nothing to count, an abort)."""
        with self._lock:
            self._sending.add(req_id)
            if ended is not None:
                stats.record(self._figures, "send", ended)

    def received(self, req_id: str, failed_blocks: tuple[int, ...] = (), ended: Ended | None = None) -> None:
        """A consumer's load ended; `failed_blocks`: the blocks that did not get their KV;
        `ended`: how, for the stats (None: nothing to count, vLLM released it)."""
        with self._lock:
            self._recving[req_id] = tuple(self._recving.get(req_id, ())) + tuple(failed_blocks)
            if ended is not None:
                stats.record(self._figures, "load", ended)

    # ---- vLLM's side ---------------------------------------------------------------------------
    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) since the last call; the failed blocks of those
        loads are what load_errors() answers until the next call."""
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, {}
            self._errors = {b for blocks in recving.values() for b in blocks}
            self._failed = {r for r, blocks in recving.items() if blocks}
            stats.merge(self._taken, self._figures)
            self._figures = stats.empty()
        return sending or None, set(recving) or None

    def load_errors(self) -> set[int]:
        with self._lock:
            return set(self._errors)

    def failed_loads(self) -> set[str]:
        with self._lock:
            return set(self._failed)

    def figures(self) -> dict:
        """The figures of the transfers finished() has reported since the last call
        (disagg.vllm.stats data; each counted once)."""
        with self._lock:
            taken, self._taken = self._taken, stats.empty()
        return taken
