"""The router's OpenAI API through the official `openai` client (issue 36, item 6): plain and
streamed completions, GET /v1/models, and errors the client shows with our message (before,
`{"error": "string"}` made it show only "Error code: 400")."""

import openai
import pytest

from disagg.tools.launcher import Launcher

COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "4096", "--max-requests", "8"]


@pytest.fixture(scope="module")
def client():
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *COMMON, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *COMMON, "--bootstrap-addr", prefill["bootstrap"])
        router = launcher.start(
            "router",
            "--pair",
            f"{prefill['http']},{decode['http']},{prefill['bootstrap']}",
            "--served-model-name",
            "tiny",
        )
        with openai.OpenAI(base_url=router["http"] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_plain_and_streamed_completions_agree(client):
    plain = client.completions.create(model="tiny", prompt=list(range(1, 40)), max_tokens=5)
    assert plain.model == "tiny" and plain.usage.completion_tokens == 5
    tokens = (
        plain.model_extra["choices"][0]["token_ids"]
        if plain.model_extra.get("choices")
        else plain.choices[0].model_extra["token_ids"]
    )
    chunks = list(client.completions.create(model="tiny", prompt=list(range(1, 40)), max_tokens=5, stream=True))
    streamed = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    assert streamed == tokens and len(tokens) == 5


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"temperature": 0.7}, "temperature", "greedy only"),
        ({"extra_body": {"bogus": 1}}, "bogus", "unsupported field"),
    ],
)
def test_a_refused_request_shows_our_message_and_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2, **extra)
    error = caught.value
    assert words in error.message and error.param == param and error.type == "invalid_request_error", error.body


def test_a_text_prompt_is_refused_with_the_reason(client):
    with pytest.raises(openai.BadRequestError, match="no tokenizer"):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
