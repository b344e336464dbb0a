"""The router's view of its pairs, kept up to date in the background: /ready answers from it
at once, and a request goes only to a pair that is up (or not yet probed).

Every `every_s`, every rank of every pair is asked for its /ready and its /health, all at
once, each within `timeout_s`. A pair is down, with the reasons a person needs, when

    a rank cannot be reached, or answers /ready false        (its own `why`)
    its decode was not given the pair's bootstrap             (a name mistake between the router's
                                                               --pair and decode's --bootstrap-addr:
                                                               a configuration error, never a 4xx)
    its prefill and decode report different vocabularies     (different models)

A server with /health only (vLLM's) is probed with probe_health instead: up while it answers 200.
A pair's vocabulary (the smallest its ranks report) is what `prompt_len` requests draw their
random token ids below.

The pairs are the roster's of the moment (disagg/router/roster.py: --pairs-file is read again
each round), so a pair added at run time is probed before a request goes to it, and one taken
out is forgotten. With a cache index (`--route kv`), every rank that is up and has a prefix
cache (its /health has a `prefix_cache` section) is also asked what its cache changed
(disagg/router/cache_index.py) in the same round; a rank no pair names any more, or that keeps
no cache (any more), leaves the index. Each rank's /health also says its load (requests and
prompt tokens queued and running), which the round hands to the load book
(disagg/router/load.py); a rank no pair names any more leaves it.
"""

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from disagg.router.cache_index import CacheIndex
from disagg.router.load import LoadBook
from disagg.router.pairs import Pair
from disagg.router.roster import Roster

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What one rank said: why it cannot serve (None: it can) and its /health."""

    why: str | None
    health: dict


@dataclass(frozen=True)
class PairState:
    up: bool | None  # None: not probed yet (a request may still try it)
    why: tuple[str, ...] = ()
    vocab_size: int | None = None  # the smallest vocabulary its ranks report


NOT_PROBED = PairState(None, ("not probed yet",))


def caches(health: dict) -> bool:
    """A rank that keeps a prefix cache (and so answers /cache/events) says so in /health."""
    return isinstance(health.get("prefix_cache"), dict)


MAX_ANSWER_BYTES = 1 << 20  # a worker's /ready or /health answer: far more than any real one


def fetch(url: str, timeout_s: float) -> tuple[int, dict]:
    """GET url -> (status, JSON object); status 0 with {"error": ...} when unreachable or when
    the answer is over MAX_ANSWER_BYTES (untrusted: the router never reads more than that)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            raw = resp.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                return 0, {"error": f"answer over {MAX_ANSWER_BYTES} bytes"}
            return resp.status, _object(raw)
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, _object(exc.read(1 << 16))
        except (OSError, http.client.HTTPException):
            return exc.code, {}
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        return 0, {"error": str(getattr(exc, "reason", exc))}


def _object(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def probe(url: str, timeout_s: float) -> Probe:
    status, ready = fetch(url + "/ready", timeout_s)
    if status == 0:
        return Probe(f"unreachable at {url} ({ready.get('error', 'no answer')})", {})
    health_status, health = fetch(url + "/health", timeout_s)
    if health_status == 0:  # unreachable now, or an answer over the bound: nothing known of it
        health = {}
    if status == 200 and ready.get("ready") is True:
        return Probe(None, health)
    why = ready.get("why")
    return Probe(f"not ready (HTTP {status}{': ' + str(why)[:300] if why else ''})", health)


def probe_health(url: str, timeout_s: float) -> Probe:
    """A server that has /health only (vLLM's api_server): up while it answers 200."""
    status, health = fetch(url + "/health", timeout_s)
    if status == 0:
        return Probe(f"unreachable at {url} ({health.get('error', 'no answer')})", {})
    return Probe(None if status == 200 else f"not healthy (HTTP {status})", {})


def judge(pair: Pair, prefill: list[Probe], decode: list[Probe]) -> PairState:
    """A pair's state from its ranks' probes."""
    why = [
        f"{role}{f' rank {rank}' if len(probes) > 1 else ''}: {p.why}"
        for role, probes in (("prefill", prefill), ("decode", decode))
        for rank, p in enumerate(probes)
        if p.why is not None
    ]
    known = decode[0].health.get("bootstraps") if decode else None
    if isinstance(known, list) and pair.bootstrap not in known:
        why.append(
            f"decode was not given the pair's bootstrap {pair.bootstrap!r} (it knows "
            f"{', '.join(map(str, known))}): fix the router's --pair or decode's --bootstrap-addr"
        )
    vocabs = {
        role: {p.health["vocab_size"] for p in probes if type(p.health.get("vocab_size")) is int}
        for role, probes in (("prefill", prefill), ("decode", decode))
    }
    if vocabs["prefill"] and vocabs["decode"] and vocabs["prefill"] != vocabs["decode"]:
        why.append(
            f"prefill and decode report different vocabularies ({sorted(vocabs['prefill'])} vs "
            f"{sorted(vocabs['decode'])}): they serve different models"
        )
    every = vocabs["prefill"] | vocabs["decode"]
    return PairState(not why, tuple(why), min(every) if every else None)


class PairMonitor:
    def __init__(
        self,
        pairs: "tuple[Pair, ...] | Roster",
        every_s: float = 1.0,
        timeout_s: float = 2.0,
        probe_fn=probe,
        cache: CacheIndex | None = None,
        load: LoadBook | None = None,
    ):
        self.roster = pairs if isinstance(pairs, Roster) else Roster(pairs)
        self.every_s, self.timeout_s, self.probe_fn, self.cache = every_s, timeout_s, probe_fn, cache
        self.load = load
        self._states: dict[int, PairState] = {}
        self._health: dict[str, dict] = {}  # url -> its last /health
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(32, thread_name_prefix="router-probe")
        self._thread = threading.Thread(target=self._run, name="router-monitor", daemon=True)

    def start(self) -> "PairMonitor":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s * 2 + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> list[tuple[int, Pair, PairState]]:
        """The pairs served now with their numbers and states (not probed yet: up None)."""
        current = self.roster.current()
        with self._lock:
            return [(i, p, self._states.get(i, NOT_PROBED)) for i, p in current]

    def states(self) -> list[PairState]:
        return [st for _, _, st in self.snapshot()]

    def health(self, url: str) -> dict:
        """A rank's /health as last probed ({} before)."""
        with self._lock:
            return self._health.get(url, {})

    def probe_all(self) -> None:
        """One round: the roster read again, every rank at once; the states change together."""
        self.roster.reload()
        current = self.roster.current()
        urls = list(dict.fromkeys(url for _, p in current for url in (*p.prefill, *p.decode)))
        if self.load is not None:
            self.load.asking(urls)
        probes = dict(zip(urls, self._pool.map(lambda url: self.probe_fn(url, self.timeout_s), urls)))
        states = {i: judge(p, [probes[u] for u in p.prefill], [probes[u] for u in p.decode]) for i, p in current}
        with self._lock:
            before, self._states = self._states, states
            gone = set(self._health) - set(urls)
            self._health = {u: probes[u].health for u in urls}
        if self.load is not None:
            self.load.forget(gone)
            for u in urls:
                self.load.report(u, probes[u].health)
        if self.cache is not None:
            up = [u for u in urls if probes[u].why is None]
            self.cache.forget([*gone, *(u for u in up if not caches(probes[u].health))])
            list(self._pool.map(self.cache.poll, [u for u in up if caches(probes[u].health)]))
        for i, new in states.items():
            old = before.get(i, NOT_PROBED)
            if old.up is not False and new.up is False:
                log.warning("pair %d is down: %s", i, "; ".join(new.why))
            elif old.up is False and new.up:
                log.info("pair %d is up again", i)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.probe_all()
            except Exception:  # a bug here must not stop the probes (nor the router)
                log.exception("probing the pairs failed")
            self._stop.wait(self.every_s)
