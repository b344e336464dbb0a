"""Mistakes a user makes get one line naming the flag and what would work, a non-zero exit,
and no traceback (issue 16), through the real console script."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DISAGG = str(Path(sys.executable).with_name("disagg"))
POOL = [
    "--preset",
    "tiny-full",
    "--max-tokens",
    "1024",
    "--bootstrap-bind",
    "none",
    "--bootstrap-addr",
    "tcp://127.0.0.1:9",
]


def _run(*args: str, shell: str | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DISAGG_AUTH_KEY"}
    full_env["DISAGG_INSECURE"] = "1"
    if shell is not None:
        return subprocess.run(shell, shell=True, capture_output=True, text=True, env=full_env, timeout=120)
    return subprocess.run([DISAGG, *args], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.parametrize(
    "args,says",
    [
        (["prefill", *POOL, "--page-size", "12"], "--page-size: 12 is not a power of two"),
        (["prefill", *POOL, "--device", "cuda:99"], "--device cuda:99"),
        (["prefill", "--preset", "tiny-full", "--max-tokens", "2"], "capacity holds no page"),
        (["prefill", *POOL, "--max-tokens", "0"], "--max-tokens: 0 must be at least 1"),
        (["bench", "--router", "http://127.0.0.1:9", "--prompt-len", "2k"], "--prompt-len: '2k': want N or MIN:MAX"),
        (["bench", "--router", "http://127.0.0.1:9", "--concurrency", "0"], "--concurrency: 0 must be at least 1"),
        (["router", "--pair", "A"], "--pair: want PREFILL_URL,DECODE_URL,BOOTSTRAP"),
        (["router", "--pair", "http://a:1,http://b:2"], "give the bootstrap decode looks prefill up at"),
        (["router", "--backend", "vllm", "--pair", "http://a:1+http://a:2,http://b:2"], "a vLLM server is one URL"),
        (["router", "--backend", "vllm", "--pair", "http://a:1,http://b:2,main"], "vLLM pairs take no bootstrap"),
        (["router", "--pair", "127.0.0.1:1,127.0.0.1:2,main"], "'127.0.0.1:1' is not http://HOST:PORT"),
        (["decode", "--bootstrap-addr", "garbage"], "--bootstrap-addr: 'garbage': want [NAME=]tcp://HOST:PORT"),
        (
            ["demo", "--preset", "gpt-oss", "--requests", "1"],
            "--preset: invalid choice: 'gpt-oss' (choose from 'gpt-oss-120b'",
        ),
        (["prefill", *POOL, "--http-port", "70000"], "--http-port: 70000 is not a port in [0, 65535]"),
        (["prefill", *POOL, "--prefill-chunk", "-8"], "--prefill-chunk: -8"),
        (["decode", *POOL[:4], "--prefill-chunk", "8"], "--prefill-chunk is for the model engine"),
        (["decode", *POOL[:4], "--dead-after", "-1"], "--dead-after: -1 must be a positive number of seconds"),
        (
            ["decode", "--preset", "tiny-swa", "--tp-size", "3", "--device", "cpu"],
            "tiny-swa: full kv_heads (2) neither divisible by nor a divisor of TP size 3",
        ),
        (["prefill", *POOL, "--tp-size", "2", "--tp-rank", "2"], "--tp-rank 2 is not a rank of --tp-size 2 (0 .. 1)"),
        (["router", "--pair", "http://a:1+http://a:1,http://b:1,main"], "a rank's URL given twice"),
        (["router"], "give at least one --pair, or --pairs-file"),
        (["router", "--pairs-file", "/nonexistent/pairs"], "--pairs-file: [Errno 2] No such file or directory"),
        (["router", "--pairs-file", "/dev/null", "--backend", "vllm"], "--pairs-file is for --backend disagg"),
        (
            ["router", "--pair", "http://a:1,http://b:2,main", "--kv-load-weight", "-1"],
            "--kv-load-weight: -1 is not a finite number >= 0",
        ),
        (["router", "--pair", "http://a:1,http://b:2,main", "--route", "random"], "--route: invalid choice: 'random'"),
        (["prefill", *POOL[2:], "--model", "/nonexistent/model"], "--model /nonexistent/model: not a model directory"),
        (["prefill", *POOL[2:], "--model-type", "bamba", "--model-config", "{nope"], "--model-config is not JSON"),
        (
            [
                "prefill",
                *POOL[2:],
                "--model-type",
                "mamba2",
                "--device",
                "cpu",
                "--model-config",
                '{"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "head_dim": 32, "n_groups": 2, "state_size": 8, '
                '"vocab_size": 512}',
            ],
            "layer 0 (LinearAttentionLayer) filled no state",
        ),
        (
            [
                "prefill",
                *POOL[2:],
                "--model-type",
                "lfm2",
                "--device",
                "cpu",
                "--model-config",
                '{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, '
                '"num_key_value_heads": 2, "vocab_size": 512, "pad_token_id": null, "layer_types": ["conv", "full_attention"]}',
            ],
            "keeps a conv state and no recurrent state",
        ),
        (
            ["prefill", *POOL[2:], "--model-type", "no_such_type", "--device", "cpu"],
            "no_such_type-random: config refused",
        ),
        (
            ["demo", "--preset", "tiny-full", "--max-tokens", "2", "--requests", "1"],
            "`disagg prefill` did not become ready (exit code 2): disagg prefill: error: capacity holds no page",
        ),
    ],
)
def test_a_mistake_is_one_line_and_a_non_zero_exit(args, says):
    out = _run(*args)
    assert out.returncode != 0 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()[-1]) > 20


def test_no_key_is_a_clear_refusal():
    env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_AUTH_KEY", "DISAGG_INSECURE")}
    out = subprocess.run(
        [DISAGG, "decode", "--preset", "tiny-full"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and "--auth-key FILE" in out.stderr and "Traceback" not in out.stderr


def test_a_bootstrap_port_in_use_says_how_to_share_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run(
            "prefill", "--preset", "tiny-full", "--max-tokens", "1024", "--bootstrap-bind", f"tcp://127.0.0.1:{port}"
        )
    assert out.returncode == 2 and "cannot bind" in out.stderr and "--bootstrap-bind none" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_reader_that_leaves_early_is_no_error():
    out = _run(shell=f"{DISAGG} presets | head -1")
    assert out.returncode == 0 and "BrokenPipe" not in out.stderr and "Traceback" not in out.stderr


def test_a_wrong_flag_is_named_on_its_command_in_one_line():
    """Issue 36: a wrong flag to a subcommand showed the top-level usage block."""
    out = _run("prefill", "--bogus-flag")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "disagg prefill: error: unrecognized arguments: --bogus-flag (`disagg prefill --help` lists every flag)"
    ]


def test_a_bad_value_is_one_line_without_the_usage_block():
    out = _run("prefill", "--page-size", "12")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "usage:" not in out.stderr


def test_print_config_does_not_need_the_required_flags():
    out = _run("router", "--print-config")
    assert out.returncode == 0 and "max-inflight = 256" in out.stdout, out.stderr


def test_insecure_on_the_command_line_beats_a_key_in_the_environment():
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_INSECURE"}
    out = subprocess.run(
        [DISAGG, "router", "--pair", "http://a:1,http://b:2,main", "--print-config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0  # (the router takes no key: the check is on a worker below)
    env["DISAGG_AUTH_KEY"] = "/nonexistent.key"
    out = subprocess.run(
        [DISAGG, "prefill", "--insecure", "--print-config"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "insecure = true" in out.stdout and "# auth-key = (unset)" in out.stdout, out.stderr


def test_a_busy_http_port_is_found_before_the_pool_is_allocated():
    """Issue 36: the HTTP port was bound only after the pool (gigabytes) had been allocated."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _run(
            "decode",
            "--preset",
            "tiny-full",
            "--max-tokens",
            "1024",
            "--http-port",
            str(port),
            "--bootstrap-addr",
            "tcp://127.0.0.1:9",
        )
    assert out.returncode == 2 and f"HTTP 127.0.0.1:{port}: cannot bind" in out.stderr, out.stderr
    assert "pool tiny-full" not in out.stderr and "Traceback" not in out.stderr  # (the pool's size line comes first)


def test_the_routers_line_says_when_it_serves_but_is_not_ready():
    """Issue 36: the router printed 'ready' while its /ready was false."""
    import json
    import select

    from harness.processes import reap, spawn

    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    dead = f"http://127.0.0.1:{_free_port()}"
    proc = spawn(
        [DISAGG, "router", "--pair", f"{dead},{dead},main"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert select.select([proc.stdout], [], [], 60)[0]
        line = json.loads(proc.stdout.readline())
        human = next(l for l in proc.stderr if "disagg router" in l)
    finally:
        reap(proc)
    assert line["ready"] is False and line["pairs_up"] == 0
    assert human.startswith("disagg router serving (not ready: pair 0: prefill: unreachable at"), human


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
