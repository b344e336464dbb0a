"""Router: HTTP POST /generate -> pick a prefill/decode pair (round robin), assign a unique
room, call both sides concurrently, merge their outcome and per-phase timings. "control" is
the hand-off overhead: from prefill done to KV ready on decode, minus the transfer itself
(wall clocks of two hosts: exact on one host, as good as their clock sync across hosts)."""

import itertools
import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from disagg.http_api import BadRequest


@dataclass(frozen=True)
class Pair:
    prefill_url: str
    decode_url: str
    bootstrap: str

    @staticmethod
    def parse(text: str) -> "Pair":
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(f"--pair wants PREFILL_URL,DECODE_URL,BOOTSTRAP, got {text!r}")
        return Pair(*parts)


@dataclass(frozen=True)
class RouterConfig:
    pairs: tuple[Pair, ...]
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 60.0
    max_prompt_tokens: int = 1 << 20


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return {"state": "FAILED", "reason": f"HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}"}
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        return {"state": "FAILED", "reason": f"{url}: {exc}"}


class Router:
    def __init__(self, config: RouterConfig):
        if not config.pairs:
            raise ValueError("a router needs at least one prefill/decode pair")
        self.config = config
        self._next = itertools.cycle(enumerate(config.pairs))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="router")

    def generate(self, body: dict) -> dict:
        if "token_ids" in body:
            tokens = body["token_ids"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("token_ids must be a list of ints")
        elif "prompt_len" in body:
            n = body["prompt_len"]
            if not isinstance(n, int) or not 1 <= n <= self.config.max_prompt_tokens:
                raise BadRequest(f"prompt_len must be an int in [1, {self.config.max_prompt_tokens}]")
            tokens = np.random.default_rng(body.get("seed")).integers(0, 50000, n).tolist()
        else:
            raise BadRequest("give token_ids or prompt_len")
        if not tokens:
            raise BadRequest("empty prompt")
        max_new = body.get("max_new_tokens", 1)
        if not isinstance(max_new, int) or not 1 <= max_new <= 4096:
            raise BadRequest("max_new_tokens must be an int in [1, 4096]")
        with self._lock:
            pair_index, pair = next(self._next)
        room = secrets.randbits(62)
        t0 = time.perf_counter()
        timeout = self.config.timeout_s
        p = self._pool.submit(post_json, pair.prefill_url + "/prefill", {"room": room, "token_ids": tokens}, timeout)
        d = self._pool.submit(post_json, pair.decode_url + "/decode", {"room": room, "token_ids": tokens,
                                                                     "max_new_tokens": max_new,
                                                                     "bootstrap": pair.bootstrap}, timeout)
        pre, dec = p.result(), d.result()
        ok = pre.get("state") == "SUCCESS" and dec.get("state") == "SUCCESS" and dec.get("verified") is True
        control = None  # prefill done -> KV ready on decode, minus the transfer itself
        if ok and pre.get("prefill_done_at") and dec.get("kv_ready_at") and pre.get("transfer_ms") is not None:
            control = (dec["kv_ready_at"] - pre["prefill_done_at"]) * 1e3 - pre["transfer_ms"]
        return {
            "room": room, "pair": pair_index, "ok": ok, "prompt_tokens": len(tokens), "output_tokens": dec.get("output_tokens", []),
            "verified": bool(dec.get("verified")), "bytes": dec.get("bytes", 0), "mode": dec.get("mode"),
            "reason": "" if ok else (dec.get("reason") or pre.get("reason") or "unknown"),
            "timings_ms": {"bootstrap": dec.get("bootstrap_ms"), "prefill": pre.get("prefill_ms"),
                           "transfer": pre.get("transfer_ms"), "wait": dec.get("wait_ms"),
                           "verify": dec.get("verify_ms"), "decode": dec.get("decode_ms"), "control": control,
                           "total": (time.perf_counter() - t0) * 1e3},
        }
