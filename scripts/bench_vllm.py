#!/usr/bin/env python3
"""Side by side: one vLLM prefill and one decode api_server on CPU, started once with vLLM's
NixlConnector (UCX over TCP, kv_buffer_device cpu) and once with our DisaggConnector (Mooncake
TCP), the same workload through both. Runs in the vLLM venv (`scripts/setup.sh --with vllm`,
which installs nixl too); tiny random-weight models (tests/vllm_connector/tiny_models.py).

Per connector, model and prompt length (medians over --repeat fresh prompts; prompts of
k * block_size + 1 tokens, so every request computes exactly one token on decode):
  ttft_ms        what a client waits for its first token through P/D: prefill's answer (max_tokens
                 1, do_remote_decode) plus decode's (max_tokens 1, the params prefill returned),
                 driven as vLLM's toy proxy drives them
  prefill_ms, decode_ms   the two parts
  baseline_ms    decode's answer for the same prompt when its own prefix cache holds all of it
                 but the last token (asked twice locally; the second is timed): the same one-token
                 compute without any transfer
  kv_arrival_ms  decode_ms - baseline_ms: what the connector adds until the KV has landed (the
                 scheduler's lookup, handshake or registration, the transfer, the completion
                 notice, the step it waits for)
  kv_bytes       the KV a request moves: the decode blocks it loads times their bytes (both
                 connectors move whole blocks); NIXL's own count (vllm:nixl_bytes_transferred on
                 decode's /metrics) is printed beside it as nixl_bytes
  cpu_ms         user + system CPU of each server's process tree over the P/D requests, per request
Prefill runs on core 0, decode on the last core (VLLM_CPU_OMP_THREADS_BIND).

    # the tiny Llama of the e2e tests and a wider one (32 KiB of KV a token), 3 lengths each
    .venv-vllm/bin/python scripts/bench_vllm.py --models llama,wide-llama --repeat 5 --json out.json
"""

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm_connector"))

import tiny_models  # noqa: E402
import vllm_server  # noqa: E402

READY_S = 600.0
# name -> (builder, dtype, block size, blocks per prompt length, extra server args)
MODELS = {
    "llama": (tiny_models.build_tiny_llama, "float32", 32, (4, 16, 30), ()),
    "wide-llama": (tiny_models.build_wide_llama, "float32", 32, (4, 16, 32), ()),
    "gemma3": (tiny_models.build_tiny_gemma3, "float32", 32, (4, 16, 30), ()),
    "qwen3-next": (tiny_models.build_tiny_qwen3_next, "bfloat16", 256, (1, 3), ()),
}
CONNECTORS = ("nixl", "disagg")
# NIXL's UCX transports (--ucx-tls): TCP over loopback by default; "cma,tcp,self" adds UCX's own
# same-host cross-memory copy, the counterpart of our cma transport
UCX = {"tls": "tcp,self"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_config(connector: str, role: str, bootstrap: str) -> dict:
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    extra = {"bootstrap": bootstrap, "insecure": True} if role == "kv_producer" else {"insecure": True}
    return vllm_server.disagg_kv_config(role, extra)


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server and every process under it, alive now."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total


def start_server(model: Path, spec: tuple, connector: str, role: str, core: int, bootstrap: str, logs: Path) -> Server:
    _, dtype, block_size, _, extra_args = spec
    port, side_port = free_port(), free_port()
    log = logs / f"{connector}-{role}.log"
    env = vllm_server.server_env(
        core,
        kvcache_gib=2,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port),
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        UCX_TLS=UCX["tls"],
        UCX_NET_DEVICES="lo",
    )
    max_len = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    cmd = [
        *vllm_server.server_command(
            model,
            port,
            kv_config(connector, role, bootstrap),
            dtype=dtype,
            max_model_len=max_len,
            block_size=block_size,
        ),
        *extra_args,
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(role, port, proc, log)


def wait_ready(servers: list[Server]) -> None:
    give_up = time.monotonic() + READY_S
    while not all(_up(s.url + "/health") for s in servers):
        for s in servers:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited:\n{s.log.read_text()[-3000:]}")
        if time.monotonic() > give_up:
            raise RuntimeError(f"servers not ready within {READY_S:g} s")
        time.sleep(1.0)


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop(servers: list[Server]) -> None:
    for s in servers:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, 15)
    for s in servers:
        try:
            s.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, 9)
            s.proc.wait()


def post(url: str, body: dict) -> tuple[float, dict]:
    """(seconds, answer) of one JSON POST; raises with vLLM's error text."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    return time.perf_counter() - t0, answer


def nixl_bytes(decode: Server) -> float:
    """vllm:nixl_bytes_transferred_sum on decode's /metrics (0 where the connector is not NIXL)."""
    with urllib.request.urlopen(decode.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:nixl_bytes_transferred_sum")
    )


@dataclass
class Row:
    connector: str
    model: str
    prompt_tokens: int
    samples: dict = field(
        default_factory=lambda: {k: [] for k in ("ttft_ms", "prefill_ms", "decode_ms", "baseline_ms", "kv_arrival_ms")}
    )
    cpu_ms: dict = field(default_factory=dict)
    kv_bytes: int = 0
    nixl_bytes: float | None = None

    def summary(self) -> dict:
        out = {
            "connector": self.connector,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "requests": len(self.samples["ttft_ms"]),
        }
        out.update({k: round(statistics.median(v), 2) for k, v in self.samples.items()})
        out.update({"kv_bytes": self.kv_bytes, "cpu_ms_per_request": self.cpu_ms})
        if self.nixl_bytes is not None:
            out["nixl_bytes"] = round(self.nixl_bytes)
        return out


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, tiny_models.VOCAB)}" for _ in range(n))


def measure(row: Row, model: Path, prefill: Server, decode: Server, repeat: int, rng: random.Random) -> None:
    """`repeat` P/D requests of row.prompt_tokens tokens (CPU counted over them), then each
    prompt's local baseline on decode."""
    prompts = [prompt(rng, row.prompt_tokens) for _ in range(repeat)]  # a word a token (no BOS)
    base = {"model": str(model), "temperature": 0, "max_tokens": 1}
    cpu0 = (prefill.cpu_s(), decode.cpu_s())
    bytes0 = nixl_bytes(decode)
    for text in prompts:
        t_p, first = post(
            prefill.url + "/v1/completions",
            {
                **base,
                "prompt": text,
                "kv_transfer_params": {
                    "do_remote_decode": True,
                    "do_remote_prefill": False,
                    "remote_engine_id": None,
                    "remote_block_ids": None,
                    "remote_host": None,
                    "remote_port": None,
                },
            },
        )
        assert first["usage"]["prompt_tokens"] == row.prompt_tokens, first["usage"]
        t_d, _ = post(
            decode.url + "/v1/completions", {**base, "prompt": text, "kv_transfer_params": first["kv_transfer_params"]}
        )
        row.samples["prefill_ms"].append(t_p * 1e3)
        row.samples["decode_ms"].append(t_d * 1e3)
        row.samples["ttft_ms"].append((t_p + t_d) * 1e3)
    cpu1 = (prefill.cpu_s(), decode.cpu_s())
    row.cpu_ms = {
        "prefill": round((cpu1[0] - cpu0[0]) * 1e3 / repeat, 1),
        "decode": round((cpu1[1] - cpu0[1]) * 1e3 / repeat, 1),
    }
    if row.connector == "nixl":
        row.nixl_bytes = (nixl_bytes(decode) - bytes0) / repeat
    for text, t_d in zip(prompts, row.samples["decode_ms"]):
        post(decode.url + "/v1/completions", {**base, "prompt": text})
        t_b, _ = post(decode.url + "/v1/completions", {**base, "prompt": text})
        row.samples["baseline_ms"].append(t_b * 1e3)
        row.samples["kv_arrival_ms"].append(t_d - t_b * 1e3)


def kv_bytes_per_token_block(model: Path, spec: tuple) -> int:
    """Bytes of one decode block over all attention layers (K and V) of a Llama/Gemma3 config;
    0 where the geometry is not plain attention (Qwen3-Next: its state pages)."""
    cfg = json.loads((model / "config.json").read_text())
    if "linear_num_key_heads" in cfg:
        return 0
    width = 4 if spec[1] == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * width * spec[2]


def warm_up(connector: str, name: str, spec: tuple, model: Path, servers: list[Server], rng: random.Random) -> None:
    """First requests compile and connect (not counted); a failed one is tried again, twice
    (on a loaded machine NIXL's first handshake can time out: its request fails with a 500)."""
    for attempt in range(3):
        try:
            return measure(Row(connector, name, spec[2] + 1), model, *servers, 2, rng)
        except RuntimeError as exc:
            print(
                f"warm-up of {connector} {name} failed ({exc}); {'again' if attempt < 2 else 'giving up'}", flush=True
            )
    raise RuntimeError(f"{connector} {name}: warm-up failed three times")


def run_model(name: str, connector: str, repeat: int, logs: Path) -> list[dict]:
    spec = MODELS[name]
    model = spec[0](Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=logs)))
    cores = sorted(os.sched_getaffinity(0))
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    servers = [
        start_server(model, spec, connector, "kv_producer", cores[0], bootstrap, logs),
        start_server(model, spec, connector, "kv_consumer", cores[-1], bootstrap, logs),
    ]
    rows = []
    try:
        wait_ready(servers)
        rng = random.Random(f"{name}")  # the same prompts for both connectors
        warm_up(connector, name, spec, model, servers, rng)
        for blocks in spec[3]:
            row = Row(connector, name, blocks * spec[2] + 1)
            measure(row, model, *servers, repeat, rng)
            row.kv_bytes = -(-(row.prompt_tokens - 1) // spec[2]) * kv_bytes_per_token_block(model, spec)
            rows.append(row.summary())
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(servers)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama,wide-llama", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--ucx-tls", default=UCX["tls"], help="UCX_TLS for NIXL's servers (e.g. cma,tcp,self)")
    ap.add_argument("--repeat", type=int, default=5, help="P/D requests per prompt length")
    ap.add_argument("--json", type=Path, help="write the rows, the command and the machine here")
    ap.add_argument("--logs", type=Path, help="server logs and checkpoints here (default: a temporary folder)")
    args = ap.parse_args()
    UCX["tls"] = args.ucx_tls
    models, connectors = args.models.split(","), args.connectors.split(",")
    bad = sorted(set(models) - set(MODELS)) + sorted(set(connectors) - set(CONNECTORS))
    if bad or args.repeat < 1:
        ap.error(f"unknown model/connector {bad}" if bad else "--repeat must be positive")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    started, load0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    rows: list[dict] = []
    for m in models:
        for c in connectors:
            rows += run_model(m, c, args.repeat, logs)
            if args.json:  # after each pair: what was measured survives a later failure
                write_json(args.json, started, load0, rows)
    print(f"logs in {logs}")


def write_json(path: Path, started: str, load0: tuple, rows: list[dict]) -> None:
    import vllm

    path.write_text(
        json.dumps(
            {
                "command": " ".join(["scripts/bench_vllm.py", *sys.argv[1:]]),
                "date": started,
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": len(os.sched_getaffinity(0)),
                    "loadavg_before": load0,
                    "loadavg_now": os.getloadavg(),
                },
                "versions": {
                    "vllm": vllm.__version__,
                    "nixl": _version("nixl"),
                    "mooncake": _version("mooncake-transfer-engine-non-cuda"),
                },
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
