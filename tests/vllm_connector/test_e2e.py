"""End to end: two vLLM api_servers (CPU) with DisaggConnector, a producer and a consumer,
behind vLLM's own toy proxy (from its 0.32.0 sdist, as scripts/setup.sh extracts it): greedy
completions through the pair are token-identical to the consumer computing the same prompts
itself (prefix caching off, so nothing of the transfer is reused), and so are those through our
own router (`disagg router --backend vllm`) in front of the same pair, asked with the official
`openai` client. Tiny random-weight models:
Llama (full attention), Qwen3-Next (a GDN layer: its conv and SSM state move; vLLM's CPU GDN
kernels take bfloat16 only) and Gemma3 (a sliding-window group beside a full one: a 100-token
prompt leaves its window's first blocks behind).

Llama's two servers both run kv_role kv_both (either side per request, as its params say): the
Llama tests go through that role, and one asks the decode server to prefill and the prefill
server to decode. Servers start once per model (~75 s on 2 cores). vLLM's CPU workers pin themselves to
core 0 unless told otherwise (VLLM_CPU_OMP_THREADS_BIND); two servers on one core starve the
transfer's threads, so each gets a core of its own where the machine has two."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import vllm_server

ROOT = Path(__file__).resolve().parents[2]
VLLM_TESTS = Path(os.environ.get("DISAGG_VLLM_TESTS", Path(sys.prefix) / "vllm-sdist-tests"))
PROXY = VLLM_TESTS / "tests" / "v1" / "kv_connector" / "nixl_integration" / "toy_proxy_server.py"
READY_S = 400.0
# a pair's start (each server compiles its model: minutes on a loaded 2-core machine) counts
# against the first test of each model: beyond pyproject's 300 s per test
pytestmark = pytest.mark.timeout(READY_S + 200)
PROMPTS = [" ".join(f"w{(i * 37 + k * 11) % 500 + 3}" for i in range(n)) for k, n in ((1, 42), (2, 100), (3, 7))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# model fixture -> (dtype, block size (None: vLLM's own choice), tokens generated, kv_roles of
# prefill and decode). vLLM's CPU GDN kernels take bfloat16 only, and vLLM raises Qwen3-Next's
# block size to fit the GDN state in a page (160 here: not a power of two, which engine pools
# take). P/D hands decode the GDN state rounded to bf16 after N-1 prompt tokens, which a
# one-pass local prefill never rounds: on a random model greedy drifts apart after some tokens
# (7 of 12 on the 100-token prompt), so Qwen3-Next compares the first 6. Llama's servers are
# both kv_both (as vLLM's NIXL examples run them): every Llama test goes through that role, and
# one sends a request the other way round.
MODELS = {
    "tiny_qwen3_next": ("bfloat16", None, 6, ("kv_producer", "kv_consumer")),
    "tiny_gemma3": ("float32", 32, 12, ("kv_producer", "kv_consumer")),
    "tiny_llama": ("float32", 32, 12, ("kv_both", "kv_both")),
}
LOAD_S = 20
QUARANTINE_S = 5  # a failed load whose producer may still write is held this long at most


class Deployment:
    """One model's producer and consumer api_servers, vLLM's toy proxy and our router, each
    (re)started on the same port: a restarted server is the same address to the others."""

    def __init__(self, model: Path, dtype: str, block_size: int, max_tokens: int, roles: tuple, logs: Path):
        self.model, self.dtype, self.block_size, self.max_tokens, self.logs = model, dtype, block_size, max_tokens, logs
        self.roles = dict(zip(("prefill", "decode"), roles))
        names = ("prefill", "decode", "proxy", "router", "prefill-bootstrap", "decode-bootstrap")
        self.ports = {n: _free_port() for n in names}
        self.cores = sorted(os.sched_getaffinity(0))
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: list = []
        self.latest_log: dict[str, str] = {}

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def start(
        self, name: str, faults: str = "", *, block_size: int | None = None, prefix_caching: bool = False
    ) -> None:
        """(Re)start one part; `faults`: the producer's inject_faults (transfer.faults); a
        server's `block_size` (None: the model's) and prefix caching (off: nothing of a transfer
        is reused) for this start only."""
        log = (self.logs / f"{name}-{len(self.files)}.log").open("w")
        self.files.append(log)
        self.latest_log[name] = log.name
        out = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
        if name in ("prefill", "decode"):
            extra = {"inject_faults": faults} if faults else {}
            if self.roles[name] != "kv_consumer":
                extra["bootstrap"] = f"tcp://127.0.0.1:{self.ports[name + '-bootstrap']}"
            if self.roles[name] != "kv_producer":
                extra.update(load_s=LOAD_S, quarantine_s=QUARANTINE_S)
            cmd = vllm_server.server_command(
                self.model,
                self.ports[name],
                vllm_server.disagg_kv_config(self.roles[name], extra),
                dtype=self.dtype,
                max_model_len=512,
                block_size=block_size or self.block_size,
                prefix_caching=prefix_caching,
            )
            core = self.cores[0] if name == "prefill" else self.cores[-1]
            self.procs[name] = subprocess.Popen(cmd, env=vllm_server.server_env(core), **out)
        elif name == "proxy":
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    str(PROXY),
                    "--port",
                    str(self.ports[name]),
                    "--prefiller-host",
                    "127.0.0.1",
                    "--prefiller-port",
                    str(self.ports["prefill"]),
                    "--decoder-host",
                    "127.0.0.1",
                    "--decoder-port",
                    str(self.ports["decode"]),
                ],
                **out,
            )
        else:
            self.procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "disagg",
                    "router",
                    "--backend",
                    "vllm",
                    "--pair",
                    f"{self.url('prefill')},{self.url('decode')}",
                    "--http-port",
                    str(self.ports[name]),
                ],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                **out,
            )

    def wait_ready(self, names=("prefill", "decode", "proxy", "router")) -> None:
        probes = {"prefill": "/health", "decode": "/health", "proxy": "/healthcheck", "router": "/ready"}
        give_up = time.monotonic() + READY_S
        while not all(_up(self.url(n) + probes[n]) for n in names):
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > give_up:
                tails = "\n".join(f"--- {f.name}\n{Path(f.name).read_text()[-2000:]}" for f in self.files)
                raise AssertionError(f"not ready ({'exited: ' + ', '.join(dead) if dead else 'timeout'}):\n{tails}")
            time.sleep(1.0)

    def log_of(self, name: str) -> str:
        """What the part's latest start has written to its log so far."""
        return Path(self.latest_log[name]).read_text(errors="replace")

    def kill(self, name: str) -> None:
        """SIGKILL the server and everything it started (its engine core, its workers)."""
        p = self.procs.pop(name)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in self.files:
            f.close()


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """A started Deployment of one model."""
    model = request.getfixturevalue(request.param)
    d = Deployment(model, *MODELS[request.param], tmp_path_factory.mktemp("e2e-logs"))
    try:
        for name in ("prefill", "decode", "proxy", "router"):
            d.start(name)
        d.wait_ready()
        yield d
    finally:
        d.close()


def _complete(base: str, pair: Deployment, prompt: str) -> str:
    body = json.dumps(
        {"model": str(pair.model), "prompt": prompt, "max_tokens": pair.max_tokens, "temperature": 0}
    ).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_pd_through_the_proxy_is_token_identical_to_computing_locally(pair):
    local = [_complete(pair.url("decode"), pair, prompt) for prompt in PROMPTS]
    assert len(set(local)) == len(PROMPTS), local  # what is generated depends on the prompt's KV
    for prompt, want in zip(PROMPTS, local):
        assert _complete(pair.url("proxy"), pair, prompt) == want, prompt


def test_pd_through_our_router_with_the_openai_client_is_token_identical(pair):
    for prompt in PROMPTS:
        assert _openai(pair, prompt) == _complete(pair.url("decode"), pair, prompt), prompt
    with urllib.request.urlopen(pair.url("router") + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [str(pair.model)]


def _openai(pair, prompt: str) -> str:
    import openai

    client = openai.OpenAI(base_url=pair.url("router") + "/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model=str(pair.model), prompt=prompt, max_tokens=pair.max_tokens, temperature=0)
    return got.choices[0].text


def test_the_servers_metrics_show_the_bytes_the_request_moved(pair, eventually):
    """Decode's /metrics (DisaggConnector's figures through vLLM's stats) count one load of the
    bytes prefill's /metrics count as sent, and (Llama, full attention) exactly the prompt's
    blocks: layers x K and V x KV heads x head size x 4 bytes x 32 tokens each.

    Each server reports a transfer with its own engine's next step, and those run apart (on
    a loaded machine, a prefill engine's report trailed decode's by a test's length once). So
    both readings are taken where the servers agree (so far every transfer of this pair went
    prefill -> decode and landed: as many sends as loads, the same bytes): an earlier test's
    send that prefill reports late is never counted as this one's."""
    names = {"decode": ("loads", "loaded_bytes"), "prefill": ("sends", "sent_bytes")}
    readings: list[dict] = []

    def settled() -> bool:
        readings.append({side: _metrics(pair, side, names[side]) for side in names})
        return readings[-1]["decode"] == readings[-1]["prefill"]

    eventually(settled, 30, "both servers' /metrics agree on the earlier transfers", 0.2)
    before = readings[-1]
    first = _prefill(pair, PROMPTS[1])
    status, answer = _post(
        pair.url("decode") + "/v1/completions",
        {"model": str(pair.model), "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0}
        | {"kv_transfer_params": first["kv_transfer_params"]},
    )
    assert status == 200, answer
    # vLLM hands the figures to its loggers with a step's outputs
    eventually(lambda: settled() and readings[-1] != before, 30, "both servers' /metrics count the transfer", 0.2)
    moved = {side: tuple(a - b for a, b in zip(readings[-1][side], before[side])) for side in names}
    assert moved["decode"] == moved["prefill"] and moved["decode"][0] == 1 and moved["decode"][1] > 0, moved
    if pair.model.name.startswith("tiny-llama"):
        c = json.loads((pair.model / "config.json").read_text())
        blocks = -(-answer["usage"]["prompt_tokens"] // pair.block_size)
        per_block = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4 * pair.block_size
        assert moved["decode"][1] == blocks * per_block, (moved, blocks, per_block)


def _metrics(pair, side: str, names: tuple[str, ...]) -> tuple[float, ...]:
    """The sums of DisaggConnector's counters `names` on one server's /metrics."""
    with urllib.request.urlopen(pair.url(side) + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for n in names:
            if name == f"vllm:disagg_kv_{n}_total":
                got[n] += float(line.rsplit(" ", 1)[1])
    return tuple(got[n] for n in names)


@pytest.mark.parametrize("pair", ["tiny_llama"], indirect=True)
def test_streamed_and_chat_requests_through_our_router_match_decode_computing_locally(pair):
    """Through `disagg router --backend vllm` with the openai client: a streamed completion
    comes as decode's events (several chunks, the same text as decode's own answer); a chat
    completion, non-streamed and streamed, says what decode says computing the chat itself."""
    import openai

    prompt, model = PROMPTS[0], str(pair.model)
    client = openai.OpenAI(base_url=pair.url("router") + "/v1", api_key="unused", max_retries=0, timeout=120)
    local = openai.OpenAI(base_url=pair.url("decode") + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        client.completions.create(model=model, prompt=prompt, max_tokens=pair.max_tokens, temperature=0, stream=True)
    )
    assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks if c.choices) == _complete(
        pair.url("decode"), pair, prompt
    )
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[2]}],
        "max_tokens": pair.max_tokens,
        "temperature": 0,
    }
    want = local.chat.completions.create(**chat).choices[0].message.content
    assert want and client.chat.completions.create(**chat).choices[0].message.content == want
    streamed = list(client.chat.completions.create(**chat, stream=True))
    assert len(streamed) > 1 and "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.parametrize("pair", ["tiny_llama"], indirect=True)
def test_a_dead_prefill_fails_its_request_on_decode_and_the_next_is_served_once_it_is_back(pair):
    """The producer holds a prompt's KV (it answered) and is killed before the consumer loads
    it: the consumer's load fails (its bootstrap is gone) within load_s, and decode fails that
    request (vLLM's kv_load_failure_policy "fail": an error answer, no hang). Then a producer
    killed truly mid-transfer: started with the "send.stall" fault, it stops once its body's
    writes are out (it logs so) and is SIGKILLed there: decode fails that request too. A
    producer started again serves the next request, token-identical."""
    first = _prefill(pair, PROMPTS[1])
    pair.kill("prefill")
    _decode_fails(pair, PROMPTS[1], first)
    pair.start("prefill", faults="send.stall=1")
    pair.wait_ready(("prefill",))
    first = _prefill(pair, PROMPTS[1])
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_decode_fails, pair, PROMPTS[1], first)
        give_up = time.monotonic() + LOAD_S
        while "injected fault at send.stall" not in pair.log_of("prefill"):
            assert time.monotonic() < give_up and not answer.done(), pair.log_of("prefill")[-3000:]
            time.sleep(0.1)
        pair.kill("prefill")
        answer.result()
    pair.start("prefill")
    pair.wait_ready()
    assert _openai(pair, PROMPTS[0]) == _complete(pair.url("decode"), pair, PROMPTS[0])


def _prefill(pair, prompt: str, at: str = "prefill") -> dict:
    """The producer's answer to `prompt` (its kv_transfer_params name the KV it holds), from
    the server `at` (a kv_both decode server can be asked to prefill as well)."""
    status, first = _post(
        pair.url(at) + "/v1/completions",
        {
            "model": str(pair.model),
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert status == 200 and first["kv_transfer_params"]["do_remote_prefill"] is True, first
    return first


def _decode_fails(pair, prompt: str, first: dict) -> None:
    """Decode, asked for `prompt` with the producer's params, answers an error within load_s."""
    t0 = time.monotonic()
    status, answer = _post(
        pair.url("decode") + "/v1/completions",
        {
            "model": str(pair.model),
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "kv_transfer_params": first["kv_transfer_params"],
        },
    )
    assert status >= 500, answer
    assert time.monotonic() - t0 < LOAD_S + 15


@pytest.mark.parametrize("pair", ["tiny_llama"], indirect=True)
def test_kv_both_servers_swap_sides_per_request(pair, eventually):
    """Both Llama servers are kv_both: the one that decodes the other tests' requests prefills
    this one, and the prefill server decodes it from that KV (its /metrics count the load),
    token-identical to the prefill server computing the prompt itself."""
    first = _prefill(pair, PROMPTS[2], at="decode")
    loads = _metrics(pair, "prefill", ("loads",))[0]
    body = {"model": str(pair.model), "prompt": PROMPTS[2], "max_tokens": pair.max_tokens, "temperature": 0}
    status, answer = _post(
        pair.url("prefill") + "/v1/completions", body | {"kv_transfer_params": first["kv_transfer_params"]}
    )
    assert status == 200, answer
    assert answer["choices"][0]["text"] == _complete(pair.url("prefill"), pair, PROMPTS[2])
    counted = lambda: _metrics(pair, "prefill", ("loads",))[0] != loads  # noqa: E731 (the figures follow the answer)
    eventually(counted, 30, "the prefill server's /metrics count the load", 0.2)


@pytest.mark.parametrize("pair", ["tiny_llama"], indirect=True)
def test_a_decode_of_another_block_size_loads_by_token_and_a_restarted_decode_is_picked_up(pair, eventually):
    """Decode restarted with --block-size 64 (and prefix caching) beside prefill's 32: the
    prompts' KV moves by token into decode's bigger blocks, token-identical to the prefill
    server computing them itself (a colocated server); decode's /metrics count exactly the
    prompt's bytes. A prompt whose first 64 tokens decode computed itself moves only the rest.
    Restarted as before (the module's pair), decode is picked up again. One restart beyond the
    one a restarted decode costs anyway: ~75 s."""
    pair.kill("decode")
    pair.start("decode", block_size=64, prefix_caching=True)
    pair.wait_ready()
    c = json.loads((pair.model / "config.json").read_text())
    per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 4  # float32 K and V
    for prompt in PROMPTS[:2]:
        before = _metrics(pair, "decode", ("loads", "loaded_bytes"))
        assert _complete(pair.url("proxy"), pair, prompt) == _complete(pair.url("prefill"), pair, prompt), prompt
        eventually(lambda: _metrics(pair, "decode", ("loads",))[0] > before[0], 30, "decode counts the load", 0.2)
        moved = _metrics(pair, "decode", ("loaded_bytes",))[0] - before[1]
        assert moved == len(prompt.split()) * per_token, (prompt, moved)  # a word a token
    words = [f"w{(i * 53 + 7) % 500 + 3}" for i in range(110)]
    _complete(pair.url("decode"), pair, " ".join(words[:70]))  # decode caches its first 64-token block
    before = _metrics(pair, "decode", ("loads", "loaded_bytes"))
    prompt = " ".join(words)
    assert _openai(pair, prompt) == _complete(pair.url("prefill"), pair, prompt)
    eventually(lambda: _metrics(pair, "decode", ("loads",))[0] > before[0], 30, "decode counts the load", 0.2)
    assert _metrics(pair, "decode", ("loaded_bytes",))[0] - before[1] == (len(words) - 64) * per_token
    pair.kill("decode")
    pair.start("decode")
    pair.wait_ready()
    assert _openai(pair, PROMPTS[2]) == _complete(pair.url("decode"), pair, PROMPTS[2])
