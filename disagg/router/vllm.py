"""The router in front of vLLM prefill/decode pairs (`disagg router --backend vllm`): vLLM
servers with DisaggConnector (a kv_producer and a kv_consumer) behind the same router users
run in front of disagg's own workers. It speaks vLLM's P/D proxy protocol, as vLLM's toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py of its source) does:

    POST /v1/completions or /v1/chat/completions (the client's OpenAI body)
      -> prefill: the same body, max_tokens 1, not streamed,
                  kv_transfer_params {"do_remote_decode": true}
      <- its answer's kv_transfer_params (the room, the producer's bootstrap, the prompt length)
      -> decode:  the client's body with those kv_transfer_params
      <- decode's answer, status and body as they are: the client's answer; a streamed
         request ("stream": true) gets decode's server-sent events one by one as they come
         (prefill is never streamed: its one token is not the client's)

A client's own kv_transfer_params are replaced (only a producer names a room). A pair is up
while both servers answer GET /health with 200 (PairMonitor with probe_health); pairs go
round robin, skipping pairs known down. A server that cannot be reached, or a prefill
without kv_transfer_params, answers 502 with the reason; every other answer of a server (a
400 vLLM gave, a 500 of a failed load) goes to the client unchanged, a streamed one with
decode's status and message (RequestFailed) while no event has gone out yet.
"""

import itertools
import json
import logging
import threading
import urllib.error
import urllib.request

from disagg.api.fields import EventStream, Reply
from disagg.errors import RequestFailed, Unavailable
from disagg.router import openai
from disagg.router.monitor import PairMonitor, fetch, probe_health
from disagg.router.pairs import Pair
from disagg.router.router import RouterConfig

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
NOT_FORWARDED = ("stream", "stream_options", "kv_transfer_params")
DONE = b"[DONE]"


def post(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    """POST JSON -> (status, JSON object); status 0 with {"error": ...} when unreachable."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, _object(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, _object(exc.read(1 << 20))
        except OSError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return 0, {"error": str(getattr(exc, "reason", exc))}


def _object(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def relay(url: str, body: dict, timeout_s: float, send) -> None:
    """POST a streamed request and pass each of its server-sent events on (`send(event)`), as
    they arrive, up to its [DONE]. An answer other than 200, or a server not reached, raises
    RequestFailed with its status (502: unreachable) and message; an event that is not a JSON
    object is dropped (logged)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        answer = _object(exc.read(1 << 20))
        message = (answer.get("error") or {}).get("message") if isinstance(answer.get("error"), dict) else None
        raise RequestFailed(f"decode {url} answered HTTP {exc.code}: {message or answer}", exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise RequestFailed(f"decode {url} unreachable: {getattr(exc, 'reason', exc)}", 502) from None
    with resp:
        for line in resp:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == DONE:
                return
            event = _object(data)
            if event:
                send(event)
            else:
                log.warning("decode %s sent an event that is not a JSON object: %r", url, data[:200])


class VllmRouter:
    def __init__(self, config: RouterConfig):
        if not config.pairs:
            raise ValueError("a router needs at least one prefill/decode pair")
        self.config = config
        self._next = itertools.cycle(enumerate(config.pairs))
        self._lock = threading.Lock()
        self.monitor = PairMonitor(config.pairs, config.probe_every_s, probe_fn=probe_health)
        self.monitor.probe_all()
        self.monitor.start()

    def ready(self) -> dict:
        """/ready: ready while at least one pair has both servers healthy; each pair says why not."""
        states = self.monitor.states()
        pairs = [
            {
                "pair": i,
                "prefill": p.prefill[0],
                "decode": p.decode[0],
                "up": bool(st.up),
                **({"why": list(st.why)} if not st.up else {}),
            }
            for i, (p, st) in enumerate(zip(self.config.pairs, states))
        ]
        up = sum(p["up"] for p in pairs)
        return {
            "ready": up > 0,
            "pairs_up": up,
            "pairs": pairs,
            **({} if up else {"why": "no vLLM prefill/decode pair has both servers healthy"}),
        }

    def _pick(self) -> Pair:
        states = self.monitor.states()
        with self._lock:
            for _ in range(len(self.config.pairs)):
                i, pair = next(self._next)
                if states[i].up is not False:
                    return pair
        raise Unavailable(
            "no vLLM prefill/decode pair is up ("
            + "; ".join(f"pair {i}: {', '.join(st.why)}" for i, st in enumerate(states))
            + ")"
        )

    def forward(self, path: str, body: dict) -> "dict | Reply | EventStream":
        """One OpenAI request through a pair (module docstring)."""
        pair = self._pick()
        first = {k: v for k, v in body.items() if k not in NOT_FORWARDED}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
        if "max_completion_tokens" in body:
            first["max_completion_tokens"] = 1
        status, answer = post(pair.prefill[0] + path, first, self.config.timeout_s)
        if status != 200:
            return self._failed("prefill", pair.prefill[0], status, answer)
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict):
            return Reply(
                502,
                openai.error_body(
                    502,
                    f"prefill {pair.prefill[0]} answered without "
                    "kv_transfer_params (is it a kv_producer with DisaggConnector?)",
                ),
            )
        streamed = body.get("stream") is True
        second = {k: v for k, v in body.items() if k not in (("kv_transfer_params",) if streamed else NOT_FORWARDED)}
        second["kv_transfer_params"] = params
        if streamed:
            url, timeout_s = pair.decode[0] + path, self.config.timeout_s
            return EventStream(lambda send: relay(url, second, timeout_s, send))
        status, answer = post(pair.decode[0] + path, second, self.config.timeout_s)
        if status != 200:
            return self._failed("decode", pair.decode[0], status, answer)
        return answer

    @staticmethod
    def _failed(side: str, url: str, status: int, answer: dict) -> Reply:
        if status == 0:
            log.warning("%s %s unreachable: %s", side, url, answer.get("error"))
            return Reply(502, openai.error_body(502, f"{side} {url} unreachable: {answer.get('error')}"))
        log.warning("%s %s answered %d", side, url, status)
        return Reply(status, answer or openai.error_body(status, f"{side} {url} answered HTTP {status}"))

    def models(self) -> dict:
        """GET /v1/models: what the first pair's decode serves."""
        status, answer = fetch(self.config.pairs[0].decode[0] + "/v1/models", self.config.timeout_s)
        if status != 200:
            raise Unavailable(f"decode {self.config.pairs[0].decode[0]}: /v1/models answered HTTP {status}")
        return answer

    def close(self) -> None:
        self.monitor.close()


def check_pairs(pairs: tuple[Pair, ...]) -> str | None:
    """Why these pairs cannot be vLLM pairs (None: they can)."""
    for p in pairs:
        if len(p.prefill) != 1 or len(p.decode) != 1:
            return f"--pair {p}: a vLLM server is one URL (its TP ranks are its own), not several joined by +"
        if p.bootstrap:
            return (
                f"--pair {p}: vLLM pairs take no bootstrap (its producer names its own in kv_transfer_params); "
                "give PREFILL_URL,DECODE_URL"
            )
    return None
