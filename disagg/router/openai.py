"""POST /v1/completions: the OpenAI completions interface in front of the router, so serving
benchmarks and clients (vllm bench serve, sglang.bench_serving, genai-perf, the openai
package) drive a disagg pair unchanged, given prompts as token ids.

    request  prompt      token ids: [int, ...] or [[int, ...]] (one prompt). Text is refused:
                         the router holds no tokenizer (tokenize on the client)
             max_tokens  default 16 (OpenAI's)
             stream      server-sent events; stream_options.include_usage adds a usage chunk
             model       echoed (one model behind a router)
             seed, user, ignore_eos: accepted (greedy is deterministic; the models behind
                         have no end-of-text token, so every request runs max_tokens)
             sampling fields only at their greedy values (temperature 0, top_p 1, n 1, ...)
    refused  400 naming the field: sampling, logprobs, echo, stop, suffix, anything unknown
    answer   choices[0].token_ids: the generated ids; text "" (no tokenizer); finish_reason
             "length"; usage {prompt_tokens, completion_tokens, total_tokens}; "disagg":
             room, pair, per-phase timings and the colocated check where decode ran one
    stream   the first token as soon as prefill has sent the KV (the first generated token
             comes from prefill: that is the time to first token), then one chunk per token
             when decode answers (decode answers once), then usage, then [DONE]
    errors   400 what the caller can fix, 503 overloaded, 502 the pair failed, with its reason,
             as OpenAI's error object: {"error": {"message", "type", "param", "code"}} (so the
             official client shows the message); an error after the first event is an event
             holding that object
GET /v1/models: the one model behind the router (--served-model-name), OpenAI's list shape.
"""

import secrets
import time
from collections.abc import Callable

from disagg.api.fields import EventStream, optional_int
from disagg.errors import BadRequest, RequestFailed

# field -> the values that mean "greedy, nothing extra" (anything else is refused)
NEUTRAL = {
    "temperature": (0,),
    "top_p": (1,),
    "top_k": (-1, 0),
    "min_p": (0,),
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logprobs": (None,),
    "echo": (False,),
    "stop": (None, "", []),
    "stop_token_ids": (None, []),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "min_tokens": (0,),
}
FREE = ("prompt", "max_tokens", "model", "stream", "stream_options", "seed", "user", "ignore_eos")
MAX_TOKENS = 4096

# status -> OpenAI's error type (what its client raises is chosen by the status)
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "request_aborted",
    413: "invalid_request_error",
    499: "request_cancelled",
    503: "server_overloaded",
    504: "timeout_error",
}

Generate = Callable[..., dict]  # Router.generate(body, on_prefill=...) as the router process runs it


def error_body(status: int, exc: "BaseException | str") -> dict:
    """OpenAI's error object for a failed /v1 request."""
    message = exc if isinstance(exc, str) else str(exc) or type(exc).__name__
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": getattr(exc, "param", None),
            "code": None if status < 500 else str(status),
        }
    }


def models(name: str) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "disagg"}]}


def _prompt(body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        raise BadRequest(
            "prompt must be token ids ([int, ...]): this router holds no tokenizer; tokenize on the client", "prompt"
        )
    if not isinstance(prompt, list) or not prompt or any(isinstance(t, list) for t in prompt):
        raise BadRequest("prompt must be a non-empty list of token ids (or a list holding one such list)", "prompt")
    return prompt


def parse(body: dict) -> tuple[list[int], int, bool, bool]:
    """(prompt ids, max_tokens, stream, include_usage), or BadRequest naming the field."""
    unknown = sorted(k for k in body if k not in FREE and k not in NEUTRAL)
    if unknown:
        raise BadRequest(
            f"unsupported field(s) {', '.join(unknown)}; /v1/completions takes "
            f"{', '.join(FREE)} and greedy values of {', '.join(NEUTRAL)}",
            unknown[0],
        )
    for key, allowed in NEUTRAL.items():
        value = body.get(key, allowed[0])
        if isinstance(value, bool) is not isinstance(allowed[0], bool) and value is not None or value not in allowed:
            raise BadRequest(
                f"{key}={value!r} is not supported: generation is greedy only "
                f"({key} may be {' or '.join(repr(a) for a in allowed)})",
                key,
            )
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("stream must be true or false; stream_options may hold include_usage only", "stream")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest("model must be a string", "model")
    return (
        _prompt(body),
        optional_int(body, "max_tokens", 16, 1, MAX_TOKENS),
        stream,
        bool(options.get("include_usage")),
    )


class Completions:
    """The route: validates, then runs one request through `generate`."""

    def __init__(self, generate: Generate, model_name: str = "disagg"):
        self.generate, self.model_name = generate, model_name

    def __call__(self, body: dict) -> dict | EventStream:
        prompt, max_tokens, stream, include_usage = parse(body)
        head = {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
        }
        request = {"token_ids": prompt, "max_new_tokens": max_tokens, "request_id": head["id"]}
        usage = lambda n: {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,  # noqa: E731
            "total_tokens": len(prompt) + n,
        }
        choice = lambda ids, last: {
            "index": 0,
            "text": "",
            "token_ids": ids,
            "logprobs": None,  # noqa: E731
            "finish_reason": "length" if last else None,
        }
        if not stream:
            out = self._run(request)
            return {
                **head,
                "choices": [choice(out["output_tokens"], True)],
                "usage": usage(len(out["output_tokens"])),
                "disagg": {k: out[k] for k in ("room", "pair", "timings_ms", "check") if k in out},
            }

        def produce(send: Callable[[dict], None]) -> None:
            sent = 0

            def first(token: int) -> None:
                nonlocal sent
                send({**head, "choices": [choice([token], max_tokens == 1)]})
                sent = 1

            tokens = self._run(request, first)["output_tokens"]
            for i in range(sent, len(tokens)):
                send({**head, "choices": [choice([tokens[i]], i == len(tokens) - 1)]})
            if include_usage:
                send({**head, "choices": [], "usage": usage(len(tokens))})

        return EventStream(produce)

    def _run(self, request: dict, on_prefill=None) -> dict:
        out = self.generate(request, on_prefill=on_prefill)
        if not out["ok"]:
            raise RequestFailed(out["reason"], out.get("status", 502))
        return out
