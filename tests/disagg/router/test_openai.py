"""/v1/completions at unit level: what is accepted and refused, and the event stream over a
real HTTP server when the request fails before or after its first event. (Against real
processes and every model family: tests/integration/test_model_e2e.py.)"""

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.errors import BadRequest
from disagg.router.openai import Completions, parse
from disagg.router.routes import error_body


def test_parse_takes_greedy_requests_and_names_what_it_refuses():
    assert parse(
        {
            "prompt": [1, 2],
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "best_of": 1,
            "stop": [],
            "logprobs": None,
            "ignore_eos": True,
            "seed": 3,
        }
    ) == ([1, 2], 16, False, False)
    assert parse({"prompt": [[5]], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) == (
        [5],
        4,
        True,
        True,
    )
    for body, words in [
        ({"prompt": [1], "echo": 0}, "echo=0"),
        ({"prompt": [1], "temperature": False}, "temperature"),
        ({"prompt": [1], "stream": "yes"}, "stream must be"),
        ({"prompt": [1], "stream_options": {"continuous_usage_stats": True}}, "include_usage only"),
        ({"prompt": [[1], [2]]}, "list of token ids"),
        ({"prompt": ["a", "b"]}, "no tokenizer"),
        ({"prompt": [1], "model": 7}, "model must"),
        ({}, "non-empty list"),
        ({"prompt": [1], "max_tokens": 1 << 20}, "max_tokens"),
    ]:
        with pytest.raises(BadRequest, match=words):
            parse(body)


def _stream_server(generate):
    return ApiServer(
        ("127.0.0.1", 0),
        Service({"/v1/completions": Completions(generate)}, lambda: True, CollectorRegistry(), error_body=error_body),
    ).start()


def _post(api, body):
    req = urllib.request.Request(f"http://127.0.0.1:{api.port}/v1/completions", json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_failure_before_the_first_event_is_a_status_and_after_it_an_error_event():
    def fails_after_prefill(request, on_prefill):
        on_prefill(42)
        return {"ok": False, "reason": "decode failed: transfer timed out"}

    def fails_at_once(request, on_prefill):
        return {"ok": False, "reason": "prefill failed: pool gone"}

    for generate, want_status in [(fails_after_prefill, 200), (fails_at_once, 502)]:
        api = _stream_server(generate)
        try:
            status, text = _post(api, {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True})
        finally:
            api.stop()
        assert status == want_status
        if status == 200:
            events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
            assert json.loads(events[0])["choices"][0]["token_ids"] == [42]
            assert "transfer timed out" in json.loads(events[1])["error"]["message"] and events[2:] == ["[DONE]"]
        else:
            assert "pool gone" in json.loads(text)["error"]["message"]  # OpenAI's error object
