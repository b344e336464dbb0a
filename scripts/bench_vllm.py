#!/usr/bin/env python3
"""Side by side: one vLLM prefill and one decode api_server on CPU with vLLM's NixlConnector
(UCX over TCP, kv_buffer_device cpu) and another pair with our DisaggConnector (Mooncake TCP,
or cma on one host), the same workload through both. Runs in the vLLM venv (`scripts/setup.sh
--with vllm`, which installs nixl too); tiny random-weight models
(tests/vllm_connector/tiny_models.py).

Fair on a shared machine: both pairs start once per model, but only one runs at a time (the
other's process trees stopped with SIGSTOP, resumed with SIGCONT), and the measurements come in
--rounds rounds: each round measures every prompt length with one connector, then with the
other, the order swapped each round, so load drift over the run falls on both alike. After each
resume one unmeasured P/D request (what a pause may have left stale: handshakes, our peers'
liveness) before the round's requests. A row's figures are medians over all its rounds; the
JSON has the load average around each round ("rounds"), how long each pair lay stopped, and
its slowest decode leg per prompt length in that round.

Per connector, model and prompt length (medians over --rounds x --repeat fresh prompts, the
same prompts for both connectors; prompts of k * block_size + 1 tokens, so every request
computes exactly one token on decode):
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
  cpu_ms         user + system CPU of each server's process tree over one P/D request (the
                 median, as for the times: a request that a resumed NIXL pair takes seconds over
                 would otherwise dominate a row's sum)
Prefill runs on core 0, decode on the last core (VLLM_CPU_OMP_THREADS_BIND).

    # the tiny Llama of the e2e tests and a wider one (32 KiB of KV a token), 3 lengths each
    .venv-vllm/bin/python scripts/bench_vllm.py --models llama,wide-llama --rounds 4 --repeat 3 --json out.json
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
SERVER = {"kvcache_gib": 1}  # VLLM_CPU_KVCACHE_SPACE: four servers live at once (two stopped)


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

    def tree(self) -> list[psutil.Process]:
        """The server and every process under it (its engine core, its workers), alive now."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server and every process under it, alive now."""
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total


def start_server(model: Path, spec: tuple, connector: str, role: str, core: int, bootstrap: str, logs: Path) -> Server:
    _, dtype, block_size, _, extra_args = spec
    port, side_port = free_port(), free_port()
    log = logs / f"{model.name}-{connector}-{role}.log"
    env = vllm_server.server_env(
        core,
        kvcache_gib=SERVER["kvcache_gib"],
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


@dataclass
class Pair:
    """One connector's prefill and decode servers; paused (every process of both trees
    stopped) while the other connector's pair is measured."""

    connector: str
    prefill: Server
    decode: Server
    stopped: list[psutil.Process] = field(default_factory=list)
    stopped_at: float | None = None

    @property
    def servers(self) -> list[Server]:
        return [self.prefill, self.decode]

    def pause(self) -> None:
        """SIGSTOP both trees, children before their parents (none runs on while its parent is
        stopped and the pair holds still as a whole)."""
        procs = [p for s in self.servers for p in reversed(s.tree())]
        for p in procs:
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                pass
        self.stopped, self.stopped_at = procs, time.monotonic()

    def resume(self) -> float:
        """SIGCONT what pause stopped, parents first; the seconds it lay stopped."""
        for p in reversed(self.stopped):
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
        paused = time.monotonic() - self.stopped_at if self.stopped_at is not None else 0.0
        self.stopped, self.stopped_at = [], None
        return paused

    def close(self) -> None:
        """Resume (a stopped process handles no SIGTERM), then stop both servers."""
        self.resume()
        stop(self.servers)


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
    """One connector, model and prompt length: its samples over every round."""

    connector: str
    model: str
    prompt_tokens: int
    samples: dict = field(
        default_factory=lambda: {k: [] for k in ("ttft_ms", "prefill_ms", "decode_ms", "baseline_ms", "kv_arrival_ms")}
    )
    cpu_ms: dict = field(default_factory=lambda: {"prefill": [], "decode": []})  # a sample per P/D request
    rounds: int = 0
    kv_bytes: int = 0
    nixl_bytes: float | None = None  # summed over the P/D requests

    def summary(self) -> dict:
        n = len(self.samples["ttft_ms"])
        out = {
            "connector": self.connector,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens,
            "rounds": self.rounds,
            "requests": n,
        }
        out.update({k: round(statistics.median(v), 2) for k, v in self.samples.items()})
        out.update(
            {
                "kv_bytes": self.kv_bytes,
                "cpu_ms_per_request": {side: round(statistics.median(v), 1) for side, v in self.cpu_ms.items()},
            }
        )
        if self.nixl_bytes is not None:
            out["nixl_bytes"] = round(self.nixl_bytes / n)
        return out


def prompt(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(3, tiny_models.VOCAB)}" for _ in range(n))


def pd_request(model: Path, prefill: Server, decode: Server, text: str) -> tuple[float, float, dict]:
    """One request through P/D as vLLM's toy proxy drives it: (prefill's seconds, decode's
    seconds, prefill's answer)."""
    base = {"model": str(model), "temperature": 0, "max_tokens": 1, "prompt": text}
    t_p, first = post(
        prefill.url + "/v1/completions",
        {
            **base,
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
    t_d, _ = post(decode.url + "/v1/completions", {**base, "kv_transfer_params": first["kv_transfer_params"]})
    return t_p, t_d, first


def measure(row: Row, model: Path, pair: Pair, prompts: list[str]) -> None:
    """The P/D requests of `prompts` (row.prompt_tokens tokens each; CPU counted over them),
    then each prompt's local baseline on decode; added to the row as one more round."""
    prefill, decode = pair.prefill, pair.decode
    bytes0 = nixl_bytes(decode)
    decode_ms = []
    for text in prompts:
        cpu0 = (prefill.cpu_s(), decode.cpu_s())
        t_p, t_d, first = pd_request(model, prefill, decode, text)
        row.cpu_ms["prefill"].append((prefill.cpu_s() - cpu0[0]) * 1e3)
        row.cpu_ms["decode"].append((decode.cpu_s() - cpu0[1]) * 1e3)
        assert first["usage"]["prompt_tokens"] == row.prompt_tokens, first["usage"]  # a word a token (no BOS)
        decode_ms.append(t_d * 1e3)
        row.samples["prefill_ms"].append(t_p * 1e3)
        row.samples["decode_ms"].append(t_d * 1e3)
        row.samples["ttft_ms"].append((t_p + t_d) * 1e3)
    if row.connector == "nixl":
        row.nixl_bytes = (row.nixl_bytes or 0.0) + nixl_bytes(decode) - bytes0
    base = {"model": str(model), "temperature": 0, "max_tokens": 1}
    for text, t_d in zip(prompts, decode_ms):
        post(decode.url + "/v1/completions", {**base, "prompt": text})
        t_b, _ = post(decode.url + "/v1/completions", {**base, "prompt": text})
        row.samples["baseline_ms"].append(t_b * 1e3)
        row.samples["kv_arrival_ms"].append(t_d - t_b * 1e3)
    row.rounds += 1


def kv_bytes_per_token_block(model: Path, spec: tuple) -> int:
    """Bytes of one decode block over all attention layers (K and V) of a Llama/Gemma3 config;
    0 where the geometry is not plain attention (Qwen3-Next: its state pages)."""
    cfg = json.loads((model / "config.json").read_text())
    if "linear_num_key_heads" in cfg:
        return 0
    width = 4 if spec[1] == "float32" else 2
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * width * spec[2]


def warm_up(pair: Pair, model: Path, texts: list[str], what: str) -> int:
    """Unmeasured P/D requests of `texts` (the first ones compile and connect; one after each
    resume finds what the pause left stale); a failed one is tried again, twice (on a loaded
    machine NIXL's first handshake can time out: its request fails with a 500). The tries it
    took."""
    for attempt in range(3):
        try:
            for text in texts:
                pd_request(model, pair.prefill, pair.decode, text)
            return attempt + 1
        except RuntimeError as exc:
            print(f"{what} of {pair.connector} failed ({exc}); {'again' if attempt < 2 else 'giving up'}", flush=True)
    raise RuntimeError(f"{pair.connector}: {what} failed three times")


def start_pair(model: Path, spec: tuple, connector: str, logs: Path, rng: random.Random) -> Pair:
    """A connector's prefill (core 0) and decode (the last core), ready and warmed up."""
    cores = sorted(os.sched_getaffinity(0))
    bootstrap = f"tcp://127.0.0.1:{free_port()}"
    pair = Pair(
        connector,
        start_server(model, spec, connector, "kv_producer", cores[0], bootstrap, logs),
        start_server(model, spec, connector, "kv_consumer", cores[-1], bootstrap, logs),
    )
    try:
        wait_ready(pair.servers)
        warm_up(pair, model, [prompt(rng, spec[2] + 1) for _ in range(2)], "warm-up")
    except BaseException:
        pair.close()
        raise
    return pair


def run_model(name: str, connectors: list[str], repeat: int, rounds: int, logs: Path, log: list) -> list[dict]:
    """Both pairs started (the one not measured stopped), then `rounds` rounds; the rows."""
    spec = MODELS[name]
    model = spec[0](Path(tempfile.mkdtemp(prefix=f"bench-{name}-", dir=logs)))
    rng = random.Random(f"{name}")  # the same prompts for both connectors
    rows = {(c, k): Row(c, name, k * spec[2] + 1) for c in connectors for k in spec[3]}
    pairs: dict[str, Pair] = {}
    try:
        for c in connectors:
            pairs[c] = start_pair(model, spec, c, logs, rng)
            pairs[c].pause()
        for r in range(rounds):
            prompts = {k: [prompt(rng, k * spec[2] + 1) for _ in range(repeat)] for k in spec[3]}
            order = connectors if r % 2 == 0 else connectors[::-1]
            record = {"model": name, "round": r + 1, "order": order, "loadavg_start": os.getloadavg()}
            for c in order:
                record[c] = measure_round(pairs[c], model, spec, rows, prompts, rng)
            record["loadavg_end"] = os.getloadavg()
            log.append(record)
            print(json.dumps(record), flush=True)
    finally:
        for p in pairs.values():
            p.close()
    for row in rows.values():
        row.kv_bytes = -(-(row.prompt_tokens - 1) // spec[2]) * kv_bytes_per_token_block(model, spec)
    return [row.summary() for row in rows.values() if row.rounds]


def measure_round(pair: Pair, model: Path, spec: tuple, rows: dict, prompts: dict, rng: random.Random) -> dict:
    """Resume the pair, one unmeasured request, every prompt length, pause it again; what the
    pause was (seconds stopped, tries the request after it took) and the round's slowest
    decode leg per prompt length (does a pause still show after the first request?)."""
    paused = pair.resume()
    slowest = []
    try:
        tries = warm_up(pair, model, [prompt(rng, spec[2] + 1)], "the request after a resume")
        for k, texts in prompts.items():
            row = rows[pair.connector, k]
            measure(row, model, pair, texts)
            slowest.append(round(max(row.samples["decode_ms"][-len(texts) :])))
    finally:
        pair.pause()
    return {"stopped_s": round(paused, 1), "tries_after_resume": tries, "slowest_decode_ms": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama,wide-llama", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help="measured in this order in odd rounds")
    ap.add_argument("--ucx-tls", default=UCX["tls"], help="UCX_TLS for NIXL's servers (e.g. cma,tcp,self)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (each: every length with each connector)")
    ap.add_argument("--repeat", type=int, default=3, help="P/D requests per prompt length and round")
    ap.add_argument("--kvcache-gib", type=int, default=SERVER["kvcache_gib"], help="VLLM_CPU_KVCACHE_SPACE a server")
    ap.add_argument("--json", type=Path, help="write the rows, the rounds, the command and the machine here")
    ap.add_argument("--logs", type=Path, help="server logs and checkpoints here (default: a temporary folder)")
    args = ap.parse_args()
    UCX["tls"], SERVER["kvcache_gib"] = args.ucx_tls, args.kvcache_gib
    models, connectors = args.models.split(","), args.connectors.split(",")
    bad = sorted(set(models) - set(MODELS)) + sorted(set(connectors) - set(CONNECTORS))
    if bad or min(args.repeat, args.rounds, args.kvcache_gib) < 1 or len(set(connectors)) != len(connectors):
        ap.error(
            f"unknown model/connector {bad}" if bad else "--repeat, --rounds, --kvcache-gib: positive; connectors once"
        )
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    started, load0 = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    rows: list[dict] = []
    rounds: list[dict] = []
    for m in models:
        done = run_model(m, connectors, args.repeat, args.rounds, logs, rounds)
        for row in done:
            print(json.dumps(row), flush=True)
        rows += done
        if args.json:  # after each model: what was measured survives a later failure
            write_json(args.json, started, load0, rows, rounds)
    print(f"logs in {logs}")


def write_json(path: Path, started: str, load0: tuple, rows: list[dict], rounds: list[dict]) -> None:
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
                "rounds": rounds,
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
