"""Router: HTTP POST /generate -> pick a prefill/decode pair (`--route kv`: where the prompt's
prefix is cached, weighed against load, disagg/router/scoring.py; `--route round-robin`), assign a unique
room, call both sides concurrently, merge their outcome and per-phase timings. "control" is
the hand-off overhead: from the last KV write's end to KV ready on decode (phases.py; wall
clocks of two hosts: exact on one host, as good as their clock sync across hosts).

Aborts: when one side fails while the other still works, the other is aborted at once (its
slots come back now, not at its deadline) and the client is answered within ABORT_GRACE_S
even if that side never answers (frozen); a client that disconnects, or names its
`request_id` in POST /abort, aborts both. At most `max_inflight` requests run at once; more
get 503 (Overloaded), as does a request that a side refused as overloaded.
"""

import http.client
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from disagg.api.fields import optional_int, stream_layers
from disagg.control.deadlines import is_timeout
from disagg.errors import BadRequest, Cancelled, Overloaded, Unavailable
from disagg.router import scoring
from disagg.router.answers import RouterAnswer, Timings, WorkerAnswer, failed, merge_ranks, read_answer
from disagg.router.cache_index import CacheIndex
from disagg.router.load import LoadBook
from disagg.router.monitor import PairMonitor, PairState, caches
from disagg.router.pairs import Pair, side_name
from disagg.router.phases import handoff_ms
from disagg.router.roster import Roster

log = logging.getLogger(__name__)

GENERATE_FIELDS = frozenset({"token_ids", "prompt_len", "seed", "max_new_tokens", "request_id", "stream_layers"})
POLL_S = 0.1  # how often a waiting request looks for a client cancel
ABORT_GRACE_S = 2.0  # how long an aborted side may take to answer before the client is answered


@dataclass(frozen=True)
class RouterConfig:
    pairs: tuple[Pair, ...]
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 60.0
    max_prompt_tokens: int = 1 << 20
    max_inflight: int = 256
    vocab_size: int = 50000  # prompt_len requests draw token ids below this (unless the pair says)
    model_name: str = "disagg"  # what /v1/models lists and /v1/completions answers name
    probe_every_s: float = 1.0  # how often every rank's /ready and /health are asked (PairMonitor)
    route: str = "kv"  # "kv": by cached prefix and load (scoring.py); "round-robin"
    kv_load_weight: float = 1.0  # scoring.py's weight of load against reuse
    pairs_file: str | None = None  # more pairs, read again when it changes (roster.py)


ROUTES = ("kv", "round-robin")


def post_json(url: str, body: dict, timeout: float) -> dict:
    """POST, never raise: a failure comes back as {"state": "FAILED", "reason", "status"}."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # its JSON body is kept: a router's 5xx still says ok, reason
        try:
            raw = exc.read(1 << 20)
        except (http.client.HTTPException, OSError) as cut:
            raw = f"(answer cut short: {cut})".encode()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = None
        parsed = parsed if isinstance(parsed, dict) else {}
        said = (
            parsed.get("reason")
            if isinstance(parsed.get("reason"), str)
            else f"HTTP {exc.code}: {_message(parsed) or raw[:500].decode(errors='replace')}"
        )
        return {"state": "FAILED", "status": exc.code, **parsed, "reason": said}
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        # a peer killed mid-answer: refused, reset, or cut short (IncompleteRead, found by the soak)
        return {"state": "FAILED", "reason": f"{url}: {getattr(exc, 'reason', exc)}", "unreachable": True}


def _message(answer: dict) -> str:
    """What a failed answer says, as text (not its JSON): its reason, or its error (ours is a
    string, OpenAI's an object with a message)."""
    said = answer.get("reason") or answer.get("error")
    if isinstance(said, dict):
        said = said.get("message")
    return str(said)[:500] if said else ""


def _failure_status(pre: WorkerAnswer, dec: WorkerAnswer, cancelled: bool) -> int:
    """The HTTP status of a failed request (README's HTTP API section lists them): 409 when
    the caller cancelled it; 500 when decode found the answer wrong (its verification of the
    KV, or the colocated check, failed; or it claimed success unverified); 503 when a worker
    could not be reached (try again, or another router); 504 when a deadline passed; 502 for
    every other failure a worker reported (a layout mismatch, a transfer error, ...)."""
    if cancelled:
        return 409
    if dec.integrity is not None or (pre.state == "SUCCESS" and dec.state == "SUCCESS"):
        return 500
    if pre.unreachable or dec.unreachable:
        return 503
    reasons = f"{pre.reason} {dec.reason}"
    if is_timeout(reasons) or "gave no answer within" in reasons:
        return 504
    return 502


def _first_write_lead(pre: WorkerAnswer) -> float | None:
    """Streamed: how long before the engine's last layer the first KV write went out."""
    sent = pre.report
    if sent is None or not sent.streamed or not sent.first_write_at or pre.prefill_done_at is None:
        return None
    return (pre.prefill_done_at - sent.first_write_at) * 1e3


def _timings(pre: WorkerAnswer, dec: WorkerAnswer, ok: bool, total_ms: float) -> Timings:
    """Each phase's time; "control" is the hand-off overhead: from the last KV write's end to
    KV ready on decode (phases.py: never a difference of a clock and a duration)."""
    sent, control, after = pre.report, None, None
    if ok and sent is not None:
        after, control = handoff_ms(pre.prefill_done_at, sent.end_at, dec.kv_ready_at)
    return Timings(
        bootstrap=dec.bootstrap_ms,
        prefill=pre.prefill_ms,
        transfer=sent.transfer_ms if sent else None,
        transfer_cpu=sent.cpu_ms if sent else None,
        wait=dec.wait_ms,
        verify=dec.verify_ms,
        decode=dec.decode_ms,
        rebuild=dec.rebuild_ms,
        check=dec.check_ms,
        control=control,
        kv_ready_after_compute=after,
        total=total_ms,
    )


def _prompt(body: dict, max_tokens: int, vocab_size: int) -> list[int]:
    if "token_ids" in body:
        tokens = body["token_ids"]
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 1 << 31 for t in tokens):
            raise BadRequest("token_ids must be a list of ints in [0, 2^31)")
        if len(tokens) > max_tokens:
            raise BadRequest(f"at most {max_tokens} prompt tokens")
    elif "prompt_len" in body:
        n, seed = body["prompt_len"], body.get("seed")
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_tokens:
            raise BadRequest(f"prompt_len must be an int in [1, {max_tokens}]")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise BadRequest("seed must be a non-negative int")
        tokens = np.random.default_rng(seed).integers(0, vocab_size, n).tolist()
    else:
        raise BadRequest("give token_ids or prompt_len")
    if not tokens:
        raise BadRequest("empty prompt")
    return tokens


def _free_tokens(health: dict) -> "int | None":
    """What a decode rank's /health (untrusted) says a new request can take, or None."""
    available = health.get("available")
    free = available.get("full_tokens") if isinstance(available, dict) else None
    return free if type(free) is int and free >= 0 else None


class Router:
    def __init__(self, config: RouterConfig):
        if not config.pairs and config.pairs_file is None:
            raise ValueError("a router needs at least one prefill/decode pair")
        if config.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}")
        self.config = config
        self.roster = Roster(config.pairs, config.pairs_file)
        self._turn = 0  # round robin: where the next turn (or tie) starts
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(config.max_inflight)
        ranks = max([len(p.prefill) + len(p.decode) for _, p in self.roster.current()] + [8])
        self._calls = ThreadPoolExecutor(ranks * config.max_inflight, thread_name_prefix="router")  # never queues
        self._aborts = ThreadPoolExecutor(8, thread_name_prefix="router-abort")
        self._live: dict[str, threading.Event] = {}  # request_id -> cancel
        self.load = LoadBook()  # every rank's load: its reports and our requests there
        self.cache = CacheIndex() if config.route == "kv" else None
        self.monitor = PairMonitor(self.roster, config.probe_every_s, cache=self.cache, load=self.load)
        self.monitor.probe_all()  # a first look before serving: requests never go to a pair known down
        self.monitor.start()

    def ready(self) -> dict:
        """/ready: ready while at least one pair is up; each pair says why not. From the
        monitor's last look (at most probe_every_s old): never waits for a worker."""
        pairs = [
            {
                "pair": i,
                "prefill": "+".join(p.prefill),
                "decode": "+".join(p.decode),
                "bootstrap": p.bootstrap,
                "up": bool(st.up),
                **({"why": list(st.why)} if not st.up else {}),
            }
            for i, p, st in self.monitor.snapshot()
        ]
        up = sum(p["up"] for p in pairs)
        return {
            "ready": up > 0,
            "pairs_up": up,
            "pairs": pairs,
            **(
                {}
                if up
                else {
                    "why": "no prefill/decode pair has both sides ready"
                    if pairs
                    else "no prefill/decode pair is configured (--pairs-file is empty)"
                }
            ),
        }

    def _pick(self, tokens: "np.ndarray | None") -> "tuple[int, Pair, PairState, int | None]":
        """The pair a request goes to, among those not known down: round robin, or (`--route
        kv`) the cheapest by scoring.py, ties in round-robin order; Unavailable (503) with every
        pair's reasons when none is up. `tokens` None: the prompt is not known yet (drawn at
        random: nothing of it is cached). With it the prompt tokens the index predicts the
        chosen prefill will not compute (None: no prediction: round robin, or a prefill whose
        cache the index has no copy of)."""
        pairs = self.monitor.snapshot()
        up = [c for c in pairs if c[2].up is not False]
        if not up:
            reasons = "; ".join(f"pair {i}: {', '.join(st.why)}" for i, _, st in pairs) or "no pair configured"
            raise Unavailable(f"no prefill/decode pair is up ({reasons})")
        with self._lock:
            start = self._turn % len(up)
        if self.cache is None:
            chosen, turned, predicted = start, True, None
        else:
            n, weight = len(tokens) if tokens is not None else 0, self.config.kv_load_weight
            chains: dict = {}  # the prompt's keys per page size, computed once for every pair
            candidates = [self._candidate(p, tokens, chains) for _, p, _ in up]
            chosen, turned = scoring.choose(candidates, n, weight, start), scoring.tied(candidates, n, weight)
            known = tokens is not None and self.cache.indexed(up[chosen][1].prefill)
            predicted = candidates[chosen].prefill_cached if known else None
        if turned:
            with self._lock:
                self._turn = start + 1
        return (*up[chosen], predicted)

    def _candidate(self, pair: Pair, tokens: "np.ndarray | None", chains: dict) -> scoring.Candidate:
        """What scoring.py weighs of one pair: its decode's (and prefill's) cached prefix of the
        prompt, the load of its two instances (the load book: our requests there, and what
        their /health reports hold of other routers'), its decode's free tokens (/health)."""
        free = [_free_tokens(self.monitor.health(u)) for u in pair.decode]
        known = [f for f in free if f is not None]
        cached = lambda urls: self.cache.cached_tokens(urls, tokens, chains) if tokens is not None else 0
        return scoring.Candidate(
            decode_cached=cached(pair.decode),
            prefill_cached=cached(pair.prefill),
            inflight=self.load.tokens(pair.prefill) + self.load.tokens(pair.decode),
            free=min(known) if len(known) == len(free) else None,
        )

    def abort(self, body: dict) -> dict:
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise BadRequest("request_id must be a string")
        with self._lock:
            cancel = self._live.get(request_id)
        if cancel is not None:
            cancel.set()
        return {"request_id": request_id, "aborted": cancel is not None}

    def generate(self, body: dict, client_gone=lambda: False, on_prefill=None) -> dict:
        """One request through a pair. `on_prefill(first_token)` (optional) is called on this
        thread as soon as prefill has finished, KV sent: the first generated token is known
        then, before decode answers (what a streaming client sees first). Every pair down:
        a failed answer with status 503 and their reasons, sent to no worker."""
        try:
            out = self._generate(body, client_gone, on_prefill)
        except Unavailable as exc:
            log.warning("request refused (Unavailable): %s", exc)
            return {
                "room": None,
                "pair": None,
                "ok": False,
                "status": 503,
                "prompt_tokens": 0,
                "output_tokens": [],
                "verified": False,
                "bytes": 0,
                "reason": str(exc),
                "timings_ms": {},
            }
        except (BadRequest, Overloaded) as exc:
            log.warning("request refused (%s): %s", type(exc).__name__, exc)
            raise
        if not out["ok"]:
            log.warning("request failed: room %d, pair %d, %s", out["room"], out["pair"], out["reason"])
        return out

    def _generate(self, body: dict, client_gone, on_prefill) -> dict:
        unknown = sorted(set(body) - GENERATE_FIELDS)
        if unknown:  # (`max_new_token` used to give 1 token without a word)
            raise BadRequest(
                f"unknown field(s) {', '.join(map(repr, unknown))}; /generate takes "
                f"{', '.join(sorted(GENERATE_FIELDS))}",
                unknown[0],
            )
        given = _prompt(body, self.config.max_prompt_tokens, 1) if "token_ids" in body else None
        try:
            pair_index, pair, state, predicted = self._pick(
                None if given is None else np.asarray(given, dtype=np.int64)
            )
        except Unavailable:  # a request that is wrong is still a 400, pairs down or not
            _prompt(body, self.config.max_prompt_tokens, 1)
            raise
        tokens = (
            given
            if given is not None
            else _prompt(body, self.config.max_prompt_tokens, state.vocab_size or self.config.vocab_size)
        )
        max_new = optional_int(body, "max_new_tokens", 1, 1, 4096)
        request_id = body.get("request_id")
        if request_id is not None and (not isinstance(request_id, str) or not 0 < len(request_id) <= 128):
            raise BadRequest("request_id must be a string of 1 to 128 characters")
        layers = stream_layers(body)
        if not self._slots.acquire(blocking=False):
            raise Overloaded(f"{self.config.max_inflight} requests in flight")
        cancel = threading.Event()
        try:
            if request_id is not None:
                with self._lock:
                    if request_id in self._live:
                        raise BadRequest(f"request_id {request_id!r} is already in flight")
                    self._live[request_id] = cancel
            self._load(pair, len(tokens))
            try:
                return self._run(
                    pair_index,
                    pair,
                    tokens,
                    max_new,
                    cancel,
                    client_gone,
                    on_prefill=on_prefill,
                    stream_layers=layers,
                    predicted=predicted,
                )
            finally:
                self._load(pair, -len(tokens))
                self._after(pair)
        finally:
            if request_id is not None:
                with self._lock:
                    if self._live.get(request_id) is cancel:
                        del self._live[request_id]
            self._slots.release()

    def _after(self, pair: Pair) -> None:
        """A request ended on `pair`: its pages are in the caches of its prefill (computed) and
        its decode (received) now, so the index reads both before the next turn is routed."""
        if self.cache is not None:
            for url in (*pair.prefill, *pair.decode):
                if caches(self.monitor.health(url)):
                    self.cache.poll(url)

    def _load(self, pair: Pair, tokens: int) -> None:
        """Count a request's tokens in (or, negative, out of) flight on every rank of both of
        its instances."""
        self.load.sent((*pair.prefill, *pair.decode), tokens)

    def _run(
        self,
        pair_index: int,
        pair: Pair,
        tokens: list[int],
        max_new: int,
        cancel: threading.Event,
        client_gone,
        *,
        on_prefill,
        stream_layers: str | None = None,
        predicted: int | None = None,
    ) -> dict:
        room = secrets.randbits(62)
        t0 = time.perf_counter()
        calls = self._start(pair, room, tokens, max_new, stream_layers)
        results, why = self._collect(calls, pair, room, cancel, client_gone, on_prefill)
        pre = merge_ranks([results["prefill", r] for r in range(len(pair.prefill))], "prefill")
        dec = merge_ranks([results["decode", r] for r in range(len(pair.decode))], "decode")
        cancelled = why == "cancelled by the client"
        if cancelled and client_gone():
            raise Cancelled(why)  # nobody to answer: HTTP 499 for the log
        if 503 in (pre.status, dec.status):
            raise Overloaded(f"{dec.reason if dec.status == 503 else pre.reason} (room {room}, pair {pair_index})")
        refused = [side.reason for side in (dec, pre) if side.status == 400]
        if refused:  # the caller's mistake (e.g. a token id outside the vocabulary): a 400 here too
            raise BadRequest(f"{refused[0]} (room {room}, pair {pair_index})")
        ok = pre.state == "SUCCESS" and dec.state == "SUCCESS" and dec.verified is True
        return RouterAnswer(
            room=room,
            pair=pair_index,
            ok=ok,
            status=200 if ok else _failure_status(pre, dec, cancelled),
            prompt_tokens=len(tokens),
            output_tokens=dec.output_tokens,
            verified=bool(dec.verified),
            check=dec.check,
            nbytes=dec.report.nbytes if dec.report else 0,
            prefix_tokens=dec.prefix_tokens,
            reused_bytes=dec.reused_bytes,
            prefill_cached_tokens=pre.prefix_tokens,
            prefill_cached_predicted=predicted,
            mode=dec.report.mode if dec.report else None,
            transport=dec.report.transport if dec.report else None,
            streamed=bool(pre.report and pre.report.streamed),
            layer_groups=pre.report.groups if pre.report else None,
            prepared_ahead=bool(pre.report and pre.report.prepared_ahead),
            fanout=pre.report.fanout if pre.report else 0,
            first_write_before_compute_end_ms=_first_write_lead(pre) if ok else None,
            reason="" if ok else (why if cancelled else dec.reason or pre.reason or "unknown"),
            timings_ms=_timings(pre, dec, ok, (time.perf_counter() - t0) * 1e3),
        ).to_dict()

    def _start(
        self, pair: Pair, room: int, tokens: list[int], max_new: int, stream_layers: str | None
    ) -> dict[Future, tuple[str, int, str]]:
        """Post the request to every rank of both instances at once: future -> (role, rank, URL)."""
        calls = {}
        for role, urls, body in (
            (
                "prefill",
                pair.prefill,
                {
                    "room": room,
                    "token_ids": tokens,
                    "decode_tp": len(pair.decode),
                    **({"stream_layers": stream_layers} if stream_layers else {}),
                },
            ),
            (
                "decode",
                pair.decode,
                {"room": room, "token_ids": tokens, "max_new_tokens": max_new, "bootstrap": pair.bootstrap},
            ),
        ):
            for rank, url in enumerate(urls):  # every rank of both instances takes part
                calls[self._calls.submit(post_json, f"{url}/{role}", body, self.config.timeout_s)] = (role, rank, url)
        return calls

    def _collect(
        self,
        calls: dict[Future, tuple[str, int, str]],
        pair: Pair,
        room: int,
        cancel: threading.Event,
        client_gone,
        on_prefill,
    ) -> tuple[dict[tuple[str, int], WorkerAnswer], str | None]:
        """Every rank's answer, and why the request failed or was cancelled (None: it did not):
        the first failure or cancellation aborts the other ranks at once; the first token goes
        to `on_prefill` once every prefill rank sent its KV."""
        results: dict[tuple[str, int], WorkerAnswer] = {}
        pending, why, prefilled = set(calls), None, False
        while pending:
            done, pending = wait(pending, POLL_S, FIRST_COMPLETED)
            for f in done:
                role, rank, _ = calls[f]
                out = results[role, rank] = read_answer(f.result(), side_name(role, rank, pair))
                if why is None and out.state != "SUCCESS":
                    why = f"{side_name(role, rank, pair)} failed: {out.reason[:200]}"
            if (
                why is None
                and not prefilled
                and on_prefill is not None
                and all(("prefill", r) in results for r in range(len(pair.prefill)))
            ):
                prefilled = True  # every prefill rank sent its KV: the first token is known
                if results["prefill", 0].first_token is not None:
                    try:
                        on_prefill(results["prefill", 0].first_token)
                    except OSError:  # the streaming client went away: decode is aborted below
                        why = "cancelled by the client"
            if why is None and (cancel.is_set() or client_gone()):
                why = "cancelled by the client"
            if why is not None and pending:  # every other rank stops now instead of at its deadline
                for f in pending:
                    self._aborts.submit(post_json, calls[f][2] + "/abort", {"room": room, "reason": why}, 5.0)
                break
        self._after_abort(calls, pending, results, pair)
        return results, why

    @staticmethod
    def _after_abort(
        calls: dict[Future, tuple[str, int, str]],
        pending: set[Future],
        results: dict[tuple[str, int], WorkerAnswer],
        pair: Pair,
    ) -> None:
        """An aborted rank's answer is awaited briefly, never for its whole deadline; a frozen
        or unreachable one is answered for: the client is answered without it."""
        if not pending:
            return
        done, pending = wait(pending, ABORT_GRACE_S)
        for f in done:
            role, rank, _ = calls[f]
            results[role, rank] = read_answer(f.result(), side_name(role, rank, pair))
        for f in pending:
            role, rank, _ = calls[f]
            results[role, rank] = failed(
                f"{side_name(role, rank, pair)} gave no answer within {ABORT_GRACE_S:g} s of being aborted"
            )

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._aborts.shutdown(wait=False, cancel_futures=True)
        self.monitor.close()
