"""A user's own model from disk through real processes: tiny random-weight checkpoints of
four families (bamba and falcon-h1, whose layers hold K/V and a Mamba2 state side by side,
came from outside our presets; gpt-oss and qwen3-next are among them), saved with
save_pretrained and served with `--model DIR` by prefill and decode (transformers, offline),
every request's tokens, logits (bitwise) and each decode rank's bytes equal to a colocated
run. A different checkpoint of the same architecture on the other side is refused at
registration, naming the difference."""

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from harness.processes import reap, spawn

pytestmark = pytest.mark.slow

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    initializer_range=0.5,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
CHECKPOINTS = {  # name: (model type, config)
    "bamba": (
        "bamba",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_chunk_size=16,
        ),
    ),
    "falcon-h1": (
        "falcon_h1",
        dict(
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=8,
            mamba_chunk_size=16,
        ),
    ),
    "gpt-oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=2,
            sliding_window=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "qwen3-next": (
        "qwen3_next",
        dict(
            num_hidden_layers=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}
LENGTHS = [1, 9, 23]


def save(directory, model_type: str, config: dict, seed: int) -> str:
    """A tiny random-weight checkpoint (config.json + model.safetensors), as a user brings one."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **config})).save_pretrained(
            str(directory)
        )
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    saved = {name: save(root / name, t, c, seed=1) for name, (t, c) in CHECKPOINTS.items()}
    t, c = CHECKPOINTS["bamba"]
    saved["bamba-other-seed"] = save(root / "bamba-other-seed", t, c, seed=2)
    return saved


def serve(launcher: Launcher, prefill_model: str, decode_model: str) -> str:
    common = ["--device", "cpu", "--max-tokens", "1024", "--max-requests", "4", "--page-size", "4"]
    prefill = launcher.start("prefill", "--model", prefill_model, *common, "--bootstrap-bind", "tcp://127.0.0.1:*")
    decode = launcher.start(
        "decode", "--model", decode_model, *common, "--bootstrap-addr", prefill["bootstrap"], "--check-rate", "1"
    )
    router = launcher.start(
        "router", "--vocab-size", "512", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}"
    )
    return router["http"]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_saved_checkpoint_served_from_disk_equals_colocated(checkpoints, name):
    with Launcher() as launcher:
        router = serve(launcher, checkpoints[name], checkpoints[name])
        for n in LENGTHS:
            r = post_json(router + "/generate", {"prompt_len": n, "max_new_tokens": 4, "seed": n}, 120)
            assert r["ok"], (n, r.get("reason"))
            check = r["check"]
            assert check["token_match"] and check["logits_match"] and check["shard_match"], (n, check)


def test_another_checkpoint_of_the_same_architecture_is_refused_at_registration(checkpoints, eventually, tmp_path):
    """Decode registers with its prefill as it starts (issue 36): a different checkpoint keeps
    it unready, with the difference as why, and no request is sent to the pair."""
    common = ["--device", "cpu", "--max-tokens", "1024", "--max-requests", "4", "--page-size", "4"]
    env = {
        k: v
        for k, v in os.environ.items()  # (as the launcher passes them: the key, or insecure)
        if not k.startswith("DISAGG_") or k in ("DISAGG_INSECURE", "DISAGG_AUTH_KEY")
    }
    with Launcher() as launcher:
        prefill = launcher.start(
            "prefill", "--model", checkpoints["bamba"], *common, "--bootstrap-bind", "tcp://127.0.0.1:*"
        )
        port, log = _free_port(), (tmp_path / "decode.log").open("w")
        decode = spawn(
            [
                sys.executable,
                "-m",
                "disagg",
                "decode",
                "--model",
                checkpoints["bamba-other-seed"],
                *common,
                "--bootstrap-addr",
                prefill["bootstrap"],
                "--http-port",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**env, **launcher.auth_env},
        )  # the pair's key
        try:
            why = lambda: _ready(f"http://127.0.0.1:{port}").get("why", "")  # noqa: E731
            eventually(
                lambda: "layout mismatch" in why() or decode.poll() is not None,
                120,
                "decode unready with the difference",
            )
            reason = why()
        finally:
            reap(decode)
            log.close()
    said = (tmp_path / "decode.log").read_text()[-3000:]
    assert "prefill bamba vs decode bamba-other-seed" in reason and "weights: prefill sha256:" in reason, said
    assert "model config" not in reason, reason  # one architecture, one config: only the weights differ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except OSError:
        return {}
