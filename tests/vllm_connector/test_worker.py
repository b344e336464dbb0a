"""DisaggWorker between two real processes: a producer and a consumer, each over vLLM's config
(vLLM's own create_vllm_config, the tiny Llama) and KV tensors in vLLM's CPU layout or a
CUDA-style K/V-first one, the producer running the real bootstrap, Mooncake TCP on loopback,
CURVE auth (the deployment key of tests/conftest.py). The consumer's blocks end byte-equal to
the producer's, every other block untouched; a prefix-cache hit moves only the suffix; a dead
producer ends the load in load_errors within its deadline. Each side's figures for vLLM's stats
(disagg.vllm.stats) come with its finished report: the bytes of the blocks that moved, once."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
LOAD_S, DEAD_S = 6.0, 1.0
# a failed load whose producer may still write is held this long at most (a dead producer's
# loads are: it never answers that it stopped)
QUARANTINE_S = 3.0
START_S = 120.0
VLLM_TESTS = Path(os.environ.get("DISAGG_VLLM_TESTS", Path(sys.prefix) / "vllm-sdist-tests"))


class Child:
    """A worker_child.py process (one or several workers) and its JSON-line answers."""

    def __init__(self, name: str, model: Path, workers: dict, logs: Path, num_blocks=16, env: dict | None = None):
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": str(ROOT),
            "DISAGG_VLLM_TESTS": str(VLLM_TESTS),
            "MC_LOG_LEVEL": "ERROR",
            "GLOG_minloglevel": "2",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        self.log = open(logs / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "worker_child.py"), str(model), str(num_blocks), json.dumps(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> "Child":
        assert self._answer(START_S) == {"ready": True}
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
        self._answers.put(None)  # it exited

    def _answer(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            answer = None
        if answer is None:
            self.log.flush()
            raise AssertionError(f"worker process gave no answer; its log:\n{Path(self.log.name).read_text()[-3000:]}")
        return answer

    def ask(self, cmd: dict, answer_s: float = 30.0) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(answer_s)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "close"})
                self.proc.wait(timeout=30)
            except (AssertionError, BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()


@dataclass(frozen=True)
class Worker:
    """One worker of a Child."""

    child: Child
    name: str

    def step(self, **meta) -> dict:
        return self.child.ask({"op": "step", "worker": self.name, **meta})

    def wait(self, timeout: float) -> dict:
        return self.child.ask({"op": "wait", "worker": self.name, "timeout": timeout}, timeout + 10.0)

    def dump(self, path: Path) -> dict[str, torch.Tensor]:
        self.child.ask({"op": "dump", "worker": self.name, "path": str(path)})
        return torch.load(path)


def _spec(role: str, layout: str, seed: int, **extra) -> dict:
    if role != "kv_consumer":
        extra["bootstrap"] = f"tcp://127.0.0.1:{_free_port()}"
    if role != "kv_producer":
        extra.update(load_s=LOAD_S, dead_after_s=DEAD_S, quarantine_s=QUARANTINE_S)
    return {"role": role, "layout": layout, "seed": seed, "extra": extra}


def _start(
    model: Path, logs: Path, producers: dict, consumers: dict, num_blocks=16, env: dict | None = None
) -> tuple[Child, Child]:
    """A process of producer-side workers and one of consumer-side workers, started side by
    side (each imports vLLM: seconds); `env`: more of their environment."""
    producer = Child("producers", model, producers, logs, num_blocks, env=env)
    consumer = Child("consumers", model, consumers, logs, num_blocks, env=env)
    try:
        return producer.ready(), consumer.ready()
    except BaseException:
        consumer.close()
        producer.close()
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAYOUTS = {"cpu": (1, 2), "cuda-style": (1, 2), "gdn": (5, 6), "swa": (5, 6)}  # layout -> seeds


@pytest.fixture(scope="module")
def shared(tiny_llama, tmp_path_factory):
    """One producer process and one consumer process for the module, holding a worker per
    layout (vLLM's CPU layout, the CUDA-style K/V-first one, the GDN and SWA page pools) and a
    kv_both worker on each side ("both"). -> {name: (producer side, consumer side, specs)}.
    The CUDA-style pair moves over Mooncake TCP (cma off), every other over cma; both
    processes record their hops (disagg.vllm.hops)."""
    producers = {n: _spec("kv_producer", n, seeds[0]) for n, seeds in LAYOUTS.items()}
    consumers = {n: _spec("kv_consumer", n, seeds[1]) for n, seeds in LAYOUTS.items()}
    for side in (producers, consumers):
        side["cuda-style"]["extra"]["cma"] = False
    producers["both"], consumers["both"] = _spec("kv_both", "cpu", 8), _spec("kv_both", "cpu", 9)
    # another block size on each side: a producer of blocks of 32, a consumer of blocks of 64
    producers["blocks"] = _spec("kv_producer", "cpu", 10, test_block_size=32)
    consumers["blocks"] = _spec("kv_consumer", "cpu", 11, test_block_size=64)
    p, c = _start(tiny_llama, tmp_path_factory.mktemp("workers"), producers, consumers, env={"DISAGG_HOPS": "1"})
    yield {n: (Worker(p, n), Worker(c, n), producers[n], consumers[n]) for n in producers}
    c.close()
    p.close()


@pytest.fixture(params=["cpu", "cuda-style"])
def pair(request, shared):
    """(producer, consumer, bootstrap) of one layout."""
    producer, consumer, spec, _ = shared[request.param]
    return producer, consumer, spec["extra"]["bootstrap"]


def _blocks(t: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    """Block b of a layer's tensor, as bytes (K/V-first: its K and V)."""
    return (
        t[b].view(torch.uint8).flatten()
        if layout == "cpu"
        else torch.cat([t[0, b].view(torch.uint8).flatten(), t[1, b].view(torch.uint8).flatten()])
    )


def _remote(room: int, boot: str, num_tokens: int) -> dict:
    return {"room": room, "bootstrap": boot, "num_tokens": num_tokens}


def _transfer(pair, tmp_path, room, src, num_tokens, first, dst):
    """Producer holds `src` for `num_tokens` under `room`; consumer loads tokens [first,
    num_tokens) into `dst`. Returns (consumer's answer, producer's tensors, consumer's before
    and after)."""
    producer, consumer, boot = pair
    before = consumer.dump(tmp_path / "before.pt")
    producer.step(sends=[{"req_id": f"p{room}", "room": room, "num_tokens": num_tokens, "blocks": src}])
    consumer.step(
        loads=[
            {
                "req_id": f"c{room}",
                "remote": _remote(room, boot, num_tokens),
                "first": first,
                "count": num_tokens - first,
                "blocks": dst,
            }
        ]
    )
    got = consumer.wait(LOAD_S + 5)
    sent = producer.wait(10.0)
    assert sent["sending"] == [f"p{room}"]  # vLLM may free its blocks now
    got["sent_figures"] = sent["figures"]
    return got, producer.dump(tmp_path / "src.pt"), before, consumer.dump(tmp_path / "after.pt")


def _check(layout, src_t, before, after, moved: dict[int, int]) -> None:
    for name in src_t:
        n = after[name].shape[1 if layout == "cuda-style" else 0]
        for d in range(n):
            want = _blocks(src_t[name], layout, moved[d]) if d in moved else _blocks(before[name], layout, d)
            assert torch.equal(_blocks(after[name], layout, d), want), f"{name} block {d}: " + (
                f"not source block {moved[d]}" if d in moved else "changed"
            )


def test_blocks_land_byte_equal_and_nothing_else_changes(pair, request, tmp_path):
    layout = request.node.callspec.params["pair"]
    got, src_t, before, after = _transfer(pair, tmp_path, 11, [3, 4, 5, 6], 100, 0, [9, 2, 12, 13])
    assert (got["recving"], got["errors"]) == (["c11"], [])
    _check(layout, src_t, before, after, {9: 3, 2: 4, 12: 5, 13: 6})
    moved = 4 * sum(_blocks(t, layout, 0).numel() for t in src_t.values())
    _check_figures(got["figures"], "load", moved)
    _check_figures(got["sent_figures"], "send", moved)


def test_a_small_load_goes_the_loops_way_on_both_sides(pair, request, tmp_path):
    """A load from a producer rank looked up and registered with before is asked from the
    consumer's loop (no lookup thread); over cma (a synchronous copy) the producer's loop
    writes the small send itself and answers it (no transfer worker, no outbox); over
    Mooncake a transfer worker does. Each hand-over between threads waits for the GIL that
    vLLM's thread holds through its step (scripts/bench_worker_arrival.py)."""
    layout = request.node.callspec.params["pair"]
    producer, consumer, _ = pair
    _transfer(pair, tmp_path, 13, [1, 2], 64, 0, [3, 4])  # registered (if no test was before)
    for side in (producer, consumer):
        side.child.ask({"op": "hops"})
    got, *_ = _transfer(pair, tmp_path, 14, [5, 6], 64, 0, [7, 8])
    assert (got["recving"], got["errors"]) == (["c14"], [])
    marks = {
        hop: thread for side in (producer, consumer) for _, _, hop, thread in side.child.ask({"op": "hops"})["hops"]
    }
    assert "c.lookup" not in marks, marks
    assert {marks[h] for h in ("c.taken", "c.asked", "c.done")} == {"disagg-consumer"}, marks
    sending = {marks[h] for h in ("p.sending", "p.written", "p.told")}
    if layout == "cpu":
        assert sending == {"disagg-producer"} and marks["p.asked"] == "disagg-producer", marks
    else:
        assert len(sending) == 1 and sending.pop().startswith("kv-transfer-"), marks


def _check_figures(figures: dict, side: str, nbytes: int) -> None:
    """One transfer of `nbytes` on `side` ("load" / "send"), nothing else counted."""
    assert figures[f"{side}_bytes"] == [nbytes] and len(figures[f"{side}_seconds"]) == 1, figures
    assert 0 < figures[f"{side}_seconds"][0] < LOAD_S
    other = "send" if side == "load" else "load"
    assert figures[f"{other}_bytes"] == [] and figures["load_failures"] == figures["send_failures"] == 0, figures


def test_a_prefix_cache_hit_receives_only_the_suffix(pair, request, tmp_path):
    """The consumer holds the first 64 tokens (2 blocks of 32) itself: only blocks 2 and 3 of
    the prompt move, into the blocks vLLM allocated for them."""
    layout = request.node.callspec.params["pair"]
    got, src_t, before, after = _transfer(pair, tmp_path, 12, [7, 8, 10, 11], 100, 64, [14, 15])
    assert (got["recving"], got["errors"]) == (["c12"], [])
    _check(layout, src_t, before, after, {14: 10, 15: 11})


def test_two_kv_both_workers_each_send_one_request_and_load_the_other_in_one_step(shared, tmp_path):
    """kv_role kv_both: one step of each worker holds one prompt for the other and loads the
    other's; both destinations end byte-equal to their sources, nothing else changes, and
    each side's figures count one send and one load of the same bytes."""
    a, b, spec_a, spec_b = shared["both"]
    boots = spec_a["extra"]["bootstrap"], spec_b["extra"]["bootstrap"]
    before = a.dump(tmp_path / "a0.pt"), b.dump(tmp_path / "b0.pt")
    for w, room, src, other, other_room, dst in (
        (a, 61, [1, 2], boots[1], 62, [5, 6]),
        (b, 62, [3, 4], boots[0], 61, [7, 8]),
    ):
        w.step(
            sends=[{"req_id": f"p{room}", "room": room, "num_tokens": 64, "blocks": src}],
            loads=[
                {"req_id": f"c{room}", "remote": _remote(other_room, other, 64), "first": 0, "count": 64, "blocks": dst}
            ],
        )
    got = [_until(w, {f"p{room}"}, {f"c{room}"}) for w, room in ((a, 61), (b, 62))]
    after = a.dump(tmp_path / "a1.pt"), b.dump(tmp_path / "b1.pt")
    _check("cpu", after[1], before[0], after[0], {5: 3, 6: 4})
    _check("cpu", after[0], before[1], after[1], {7: 1, 8: 2})
    moved = 2 * sum(_blocks(t, "cpu", 0).numel() for t in after[0].values())
    for g in got:
        assert g["errors"] == [] and g["figures"]["send_bytes"] == g["figures"]["load_bytes"] == [moved], g


def _until(w: Worker, sending: set[str], recving: set[str]) -> dict:
    """What `w`'s finished() reports until it has reported `sending` and `recving` (figures
    and errors of every report added up)."""
    seen, out = (set(), set()), {"errors": [], "figures": {}}
    give_up = time.monotonic() + LOAD_S + 5
    while seen != (sending, recving):
        assert time.monotonic() < give_up, (seen, out)
        got = w.wait(LOAD_S)
        seen[0].update(got["sending"]), seen[1].update(got["recving"])
        out["errors"] += got["errors"]
        for k, v in got["figures"].items():
            out["figures"][k] = out["figures"].get(k, 0 if isinstance(v, int) else []) + v
    return out


def test_a_dead_producer_fails_the_load_within_its_deadline(tiny_llama, tmp_path):
    """A producer killed after it was registered: the load fails, its blocks in load errors,
    but not before quarantine_s (what a lost producer wrote may still land, and vLLM reuses
    the blocks once told) and within load_s + 1."""
    specs = _spec("kv_producer", "cpu", 3), _spec("kv_consumer", "cpu", 4)
    p, c = _start(tiny_llama, tmp_path, {"cpu": specs[0]}, {"cpu": specs[1]})
    producer, consumer, boot = Worker(p, "cpu"), Worker(c, "cpu"), specs[0]["extra"]["bootstrap"]
    try:
        got, *_ = _transfer((producer, consumer, boot), tmp_path, 21, [1, 2], 40, 0, [3, 4])  # registered
        assert got["recving"] == ["c21"]
        producer.step(sends=[{"req_id": "p22", "room": 22, "num_tokens": 40, "blocks": [5, 6]}])
        p.kill()
        t0 = time.monotonic()
        consumer.step(
            loads=[{"req_id": "c22", "remote": _remote(22, boot, 40), "first": 0, "count": 40, "blocks": [7, 8]}]
        )
        got = consumer.wait(LOAD_S + 5)
        assert (got["recving"], got["errors"]) == (["c22"], [7, 8])
        assert QUARANTINE_S <= time.monotonic() - t0 <= LOAD_S + 1.0
        assert (got["figures"]["load_failures"], got["figures"]["load_bytes"]) == (1, [])
    finally:
        c.close()
        p.close()


@pytest.fixture(params=["gdn", "swa"])
def hybrid(request, shared):
    """(producer, consumer, bootstrap, layout) over a hybrid page pool as vLLM's CPU workers
    hand it over (worker_child.hybrid_caches)."""
    producer, consumer, spec, _ = shared[request.param]
    return producer, consumer, spec["extra"]["bootstrap"], request.param


def test_hybrid_groups_move_their_pages_whole_and_nothing_else(hybrid, tmp_path):
    """GDN: the state slot (block 5 -> 9) moves whole beside the attention blocks. SWA: the
    window group's pairs with the producer's null block (it left the window) are skipped, so
    consumer block 12 keeps its bytes; every page not named is untouched."""
    producer, consumer, boot, layout = hybrid
    if layout == "gdn":
        src, dst = [[5], [3, 4, 6, 7]], [[9], [2, 10, 11, 12]]
        moved = {9: 5, 2: 3, 10: 4, 11: 6, 12: 7}
    else:
        src, dst = [[0, 3, 4, 6], [8, 9, 10, 11]], [[12, 13, 14, 15], [1, 2, 5, 7]]
        moved = {13: 3, 14: 4, 15: 6, 1: 8, 2: 9, 5: 10, 7: 11}
    got, src_t, before, after = _transfer((producer, consumer, boot), tmp_path, 31, src, 100, 0, dst)
    assert (got["recving"], got["errors"], got["failed"]) == (["c31"], [], [])
    for d in range(after["pages"].shape[0]):
        want = src_t["pages"][moved[d]] if d in moved else before["pages"][d]
        assert torch.equal(after["pages"][d], want), f"page {d}: " + (
            f"not source page {moved[d]}" if d in moved else "changed"
        )


def test_a_refused_hybrid_load_fails_by_request_not_by_block(hybrid, tmp_path):
    """A destination that does not pair with what the producer holds (GDN: a state at 99
    tokens of a room held at 100; SWA: one full block too many) is refused at once, and the
    load is reported failed by its request: vLLM refuses block-level failures for models of
    several KV cache groups."""
    producer, consumer, boot, layout = hybrid
    src = [[5], [3, 4, 6, 7]] if layout == "gdn" else [[0, 3, 4, 6], [8, 9, 10, 11]]
    dst, num_tokens = ([[9], [2, 10, 11, 12]], 99) if layout == "gdn" else ([[13, 14, 15], [1, 2, 5, 7, 8]], 100)
    producer.step(sends=[{"req_id": "p41", "room": 41, "num_tokens": 100, "blocks": src}])
    consumer.step(
        loads=[
            {"req_id": "c41", "remote": _remote(41, boot, num_tokens), "first": 0, "count": num_tokens, "blocks": dst}
        ]
    )
    got = consumer.wait(LOAD_S + 5)
    assert (got["recving"], got["errors"], got["failed"]) == (["c41"], [], ["c41"])
    assert got["waited"] < LOAD_S  # refused, not timed out


def test_a_producer_that_cannot_start_refuses_and_leaves_nothing_open(tiny_llama, tmp_path):
    """Its bootstrap port is taken: register raises (vLLM's start fails with the reason) and
    the process exits; nothing it opened keeps it waiting (a socket left open made
    zmq's context term block for ever)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        spec = _spec("kv_producer", "cpu", 7)
        spec["extra"]["bootstrap"] = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        child = Child("refused", tiny_llama, {"cpu": spec}, tmp_path)
        try:
            assert child.proc.wait(timeout=START_S) != 0
        finally:
            child.close()
    assert "bootstrap" in Path(child.log.name).read_text().splitlines()[-1]


@pytest.fixture
def blocks_32_64(shared):
    """A producer started with --block-size 32 and a consumer with 64 (vLLM's CPU layout)."""
    producer, consumer, spec, _ = shared["blocks"]
    return producer, consumer, spec["extra"]["bootstrap"]


@pytest.mark.parametrize("first,dst", [(0, [9, 2]), (64, [14])], ids=["whole-prompt", "prefix-hit"])
def test_a_consumer_of_another_block_size_gets_every_token_it_lacks(blocks_32_64, tmp_path, first, dst):
    """Blocks of 32 tokens into blocks of 64, token by token (transfer.engine_rows): each token
    the consumer lacks (all 100, or 64-100 after a prefix hit of one 64-token block) lands in
    its block at its slot, K and V of every head byte-equal; every other byte is untouched."""
    src = [3, 4, 5, 6]
    room = 51 + first
    got, src_t, before, after = _transfer(blocks_32_64, tmp_path, room, src, 100, first, dst)
    assert (got["recving"], got["errors"]) == ([f"c{room}"], [])
    for name, t in after.items():
        want = before[name].clone()  # [blocks, heads, block size, 2 * head]
        for p in range(first, 100):
            for kv in (0, 1):
                _cell(want, kv, dst[(p - first) // 64], p % 64)[:] = _cell(src_t[name], kv, src[p // 32], p % 32)
        assert torch.equal(t, want), name


# ---- TP: a producer rank serves every consumer rank holding its heads; a consumer rank pulls
# from every producer rank holding its heads (the tiny Llama's 2 KV heads split by TP) --------


class Rank:
    """One TP rank: a worker_child process holding one worker."""

    def __init__(self, child: Child):
        self.child, self.worker, self.log = child, Worker(child, "rank"), child.log

    def ready(self) -> "Rank":
        self.child.ready()
        return self

    def step(self, **meta) -> dict:
        return self.worker.step(**meta)

    def wait(self, timeout: float) -> dict:
        return self.worker.wait(timeout)

    def dump(self, path: Path) -> dict[str, torch.Tensor]:
        return self.worker.dump(path)

    def kill(self) -> None:
        self.child.kill()

    def close(self) -> None:
        self.child.close()


class Instance:
    """One TP instance: a worker_child per rank, started side by side (a producer's rank 0
    runs the bootstrap: its other ranks start once it is up, as they register there; or, with
    `rank_0_last`, the other way round, as a vLLM TP producer's ranks may come up)."""

    def __init__(self, role: str, model: Path, seed: int, logs: Path, tp: int, block_size: int, **extra):
        """`extra`: kv_connector_extra_config; `stall_rank`: the rank whose sends stall mid-way;
        `rank_0_last`: a producer's rank 0 starts once its other ranks asked its bootstrap in
        vain for longer than the bootstrap client's 5 s."""
        self.role, self.model, self.seed, self.logs, self.tp, self.block_size = role, model, seed, logs, tp, block_size
        self.stall_rank, self.rank_0_last = extra.pop("stall_rank", None), extra.pop("rank_0_last", False)
        self.extra = extra
        self.readied = 0  # ranks[:readied] said they are ready
        first = range(1, tp) if self.rank_0_last else range(1 if role == "kv_producer" else tp)
        self.ranks = [self._rank(r) for r in first]

    def _rank(self, r: int) -> Rank:
        extra = {**self.extra, "test_tp": [self.tp, r], "test_block_size": self.block_size}
        if r == self.stall_rank:
            extra["inject_faults"] = "send.stall=1"
        spec = {"role": self.role, "layout": "cpu", "seed": self.seed + r, "extra": extra}
        return Rank(Child(f"{self.role}-{self.seed + r}", self.model, {"rank": spec}, self.logs))

    def start(self) -> None:
        """Every rank started: a producer's others once its rank 0 is ready (`rank_0_last`: its
        rank 0 once the others waited for its bootstrap past the client's 5 s)."""
        if self.rank_0_last and len(self.ranks) < self.tp:
            for rank in self.ranks:
                _unanswered_past(rank.child, 5.0)
            self.ranks.insert(0, self._rank(0))
        elif len(self.ranks) < self.tp:
            self.ranks[0].ready()
            self.readied = 1
            self.ranks += [self._rank(r) for r in range(len(self.ranks), self.tp)]

    def ready(self) -> "Instance":
        self.start()
        for child in self.ranks[self.readied :]:
            child.ready()
        self.readied = len(self.ranks)
        return self

    def step(self, **meta) -> None:  # vLLM's scheduler hands every rank the same step
        for child in self.ranks:
            child.step(**meta)

    def wait(self, timeout: float) -> list[dict]:
        return [child.wait(timeout) for child in self.ranks]

    def dump(self, path: Path) -> list[dict[str, torch.Tensor]]:
        return [child.dump(path.with_name(f"{path.stem}-{self.seed}-{r}.pt")) for r, child in enumerate(self.ranks)]

    def close(self) -> None:
        for child in reversed(self.ranks):
            child.close()


@pytest.fixture(scope="module")
def tp_instances(tiny_llama, tmp_path_factory):
    """Producers TP 1 (block size 64) and TP 2 (32); consumers TP 1 (32) and TP 2 (64); for the
    dead-producer tests, a TP-1 producer (64) and a TP-2 one (32) whose (rank 1's) sends stall
    mid-transfer (send.stall)."""
    logs = tmp_path_factory.mktemp("tp")
    boots = {name: f"tcp://127.0.0.1:{_free_port()}" for name in ("p1", "p2", "stall", "stall2")}
    consumer = {"load_s": LOAD_S, "dead_after_s": DEAD_S, "quarantine_s": QUARANTINE_S}
    started = {}
    try:
        for name, args, extra in (  # TP-2 producers first: their rank 1 starts once rank 0 is ready
            ("p2", ("kv_producer", 62, 2, 32), {"bootstrap": boots["p2"]}),
            ("stall2", ("kv_producer", 70, 2, 32), {"bootstrap": boots["stall2"], "stall_rank": 1}),
            ("p1", ("kv_producer", 60, 1, 64), {"bootstrap": boots["p1"]}),
            ("stall", ("kv_producer", 64, 1, 64), {"bootstrap": boots["stall"], "stall_rank": 0}),
            ("c1", ("kv_consumer", 66, 1, 32), consumer),
            ("c2", ("kv_consumer", 68, 2, 64), consumer),
        ):
            role, seed, tp, bs = args
            started[name] = Instance(role, tiny_llama, seed, logs, tp, bs, **extra)
        for inst in started.values():
            inst.start()
        yield {name: inst.ready() for name, inst in started.items()}, boots
    finally:
        for inst in started.values():
            inst.close()


def _tp_transfer(producer: Instance, consumer: Instance, boot: str, room: int, src, dst, tmp_path):
    """`producer` holds `src` (every rank the same block ids) for 100 tokens; `consumer` loads
    them all into `dst`. Returns (each consumer rank's answer, producer ranks' tensors,
    consumer ranks' before and after)."""
    before = consumer.dump(tmp_path / "before.pt")
    producer.step(sends=[{"req_id": f"p{room}", "room": room, "num_tokens": 100, "blocks": src}])
    load = {"req_id": f"c{room}", "remote": _remote(room, boot, 100), "first": 0, "count": 100, "blocks": dst}
    consumer.step(loads=[load])
    got = consumer.wait(LOAD_S + 5)
    for answer in producer.wait(10.0):  # every producer rank's blocks may be freed now
        assert answer["sending"] == [f"p{room}"]
    return got, producer.dump(tmp_path / "src.pt"), before, consumer.dump(tmp_path / "after.pt")


def _want_by_head(src_t, before, src, dst, bs: tuple[int, int]) -> list[dict[str, torch.Tensor]]:
    """Each consumer rank's tensors as they must end: every token of the 100, every head
    (numbered across ranks: the tiny Llama's 2), K and V, from the producer rank holding it;
    every other byte as before."""
    want = [{name: t.clone() for name, t in b.items()} for b in before]
    p_heads, c_heads = 2 // len(src_t), 2 // len(before)  # KV heads per rank
    for name in want[0]:
        for g in range(2):
            for p in range(100):
                for kv in (0, 1):
                    value = _cell(src_t[g // p_heads][name], kv, src[p // bs[0]], p % bs[0])[g % p_heads]
                    _cell(want[g // c_heads][name], kv, dst[p // bs[1]], p % bs[1])[g % c_heads] = value
    return want


def _cell(t: torch.Tensor, kv: int, block: int, slot: int) -> torch.Tensor:
    """K (kv 0) or V of one slot of a block of vLLM's CPU tensor [blocks, heads, block size,
    2 * head] in its element's dtype (a byte view would transpose bytes), every head: [heads,
    head] (a view). Its kernels keep a head's K dim-major (one element of every token back to
    back), then V a row a token (test_layout checks this against the kernel)."""
    heads, size, head = t.shape[1], t.shape[2], t.shape[3] // 2
    halves = t[block].view(heads, 2, size * head)
    return (
        halves[:, 0].view(heads, head, size)[:, :, slot] if kv == 0 else halves[:, 1].view(heads, size, head)[:, slot]
    )


@pytest.mark.parametrize(
    "room,producer,consumer,src,dst,bs",
    [
        (71, "p1", "c2", [3, 4], [9, 2], (64, 64)),
        (72, "p2", "c1", [3, 4, 5, 6], [9, 2, 12, 13], (32, 32)),
        (73, "p2", "c2", [7, 8, 10, 11], [14, 15], (32, 64)),
    ],
    ids=["tp1-to-tp2", "tp2-to-tp1", "tp2-to-tp2-blocks-32-to-64"],
)
def test_tp_instances_move_every_head_byte_equal_and_nothing_else(
    tp_instances, tmp_path, room, producer, consumer, src, dst, bs
):
    """TP 1 -> 2: the producer serves both consumer ranks (half the heads each) and frees the
    room once both were sent; TP 2 -> 1: the consumer pulls from both producer ranks and
    reports the load once both landed; TP 2 -> 2 with blocks of 32 into 64: rank r from rank r,
    by token. Every head of every token byte-equal, every other byte untouched."""
    instances, boots = tp_instances
    got, src_t, before, after = _tp_transfer(
        instances[producer], instances[consumer], boots[producer], room, src, dst, tmp_path
    )
    assert [(a["recving"], a["errors"]) for a in got] == [([f"c{room}"], [])] * len(got)
    want = _want_by_head(src_t, before, src, dst, bs)
    for rank, (w, a) in enumerate(zip(want, after)):
        for name in w:
            assert torch.equal(a[name], w[name]), f"consumer rank {rank}, {name}"


def _unanswered_past(child: Child, seconds: float) -> None:
    """Wait (at most START_S) until this producer rank says its bootstrap has not answered for
    longer than `seconds` (it keeps asking); fail at once if it exited."""
    log, deadline = Path(child.log.name), time.monotonic() + START_S
    while time.monotonic() < deadline and child.proc.poll() is None:
        waited = [float(s) for s in re.findall(r"no answer yet after ([0-9.]+) s", log.read_text())]
        if waited and max(waited) > seconds:
            return
        time.sleep(0.05)  # (polling a log file for a condition, with a deadline)
    raise AssertionError(f"the rank did not wait past {seconds:g} s; its log:\n{log.read_text()[-3000:]}")


def test_a_producer_rank_started_before_its_rank_0_waits_for_the_bootstrap(tp_instances, tiny_llama, tmp_path):
    """A vLLM TP producer starts its ranks at once, so rank 1 may ask rank 0's bootstrap before
    it is up. Rank 1 started first keeps asking (each try waiting longer) past the bootstrap
    client's 5 s; rank 0 started then: both become ready, and a TP 2 -> 1 transfer moves every
    head byte-equal."""
    instances, _ = tp_instances
    boot = f"tcp://127.0.0.1:{_free_port()}"
    producer = Instance("kv_producer", tiny_llama, 76, tmp_path, 2, 32, bootstrap=boot, rank_0_last=True)
    try:
        producer.ready()
        src, dst = [3, 4, 5, 6], [9, 2, 12, 13]
        got, src_t, before, after = _tp_transfer(producer, instances["c1"], boot, 75, src, dst, tmp_path)
        assert [(a["recving"], a["errors"]) for a in got] == [(["c75"], [])]
        [want] = _want_by_head(src_t, before, src, dst, (32, 32))
        for name, t in want.items():
            assert torch.equal(after[0][name], t), name
    finally:
        producer.close()


def test_a_producer_rank_whose_bootstrap_never_answers_fails_naming_it(tiny_llama, tmp_path):
    """Rank 1 of a TP-2 producer with no rank 0: it asks the bootstrap until start_s, then its
    start fails in one line naming the bootstrap's address, and the process exits (nothing it
    opened keeps it waiting)."""
    boot = f"tcp://127.0.0.1:{_free_port()}"
    extra = {"bootstrap": boot, "start_s": 3, "test_tp": [2, 1], "test_block_size": 32}
    child = Child(
        "lone-rank-1",
        tiny_llama,
        {"rank": {"role": "kv_producer", "layout": "cpu", "seed": 78, "extra": extra}},
        tmp_path,
    )
    try:
        assert child.proc.wait(timeout=START_S) != 0
    finally:
        child.close()
    text = Path(child.log.name).read_text()
    assert f"bootstrap {boot} did not answer rank 1 within 3 s" in text.splitlines()[-1], text[-3000:]
    assert max(float(s) for s in re.findall(r"no answer yet after ([0-9.]+) s", text)) < 3.0


def test_an_abort_from_a_consumer_that_never_asked_for_the_room_changes_nothing(tp_instances, eventually):
    """TP 1 -> 2: consumer rank 0 loaded its half of a room; another registered consumer (one
    that never asked for it) aborts the room: the producer ignores it and says so, and
    consumer rank 1 still gets its half; the producer frees the room once both were sent."""
    instances, boots = tp_instances
    producer, consumer, other = instances["p1"], instances["c2"], instances["c1"]
    producer.step(sends=[{"req_id": "p83", "room": 83, "num_tokens": 100, "blocks": [3, 4]}])
    load = {"req_id": "c83", "remote": _remote(83, boots["p1"], 100), "first": 0, "count": 100, "blocks": [5, 6]}
    consumer.ranks[0].step(loads=[load])
    got = consumer.ranks[0].wait(LOAD_S + 5)
    assert (got["recving"], got["errors"]) == (["c83"], [])
    other.step(releases=[{"remote": _remote(83, boots["p1"], 100), "reason": "not mine to abort"}])
    log = Path(producer.ranks[0].log.name)
    eventually(lambda: "tried to abort room 83" in log.read_text(), 10.0, "the producer logs the abort it ignored")
    consumer.ranks[1].step(loads=[load])
    got = consumer.ranks[1].wait(LOAD_S + 5)
    assert (got["recving"], got["errors"]) == (["c83"], [])
    assert producer.wait(10.0)[0]["sending"] == ["p83"]
    assert "tried to abort room 83 of another consumer: ignored" in log.read_text()


def _stalled(eventually, child: Child, sends: int) -> None:
    """Wait (at most LOAD_S) until `sends` of this producer rank's sends stopped mid-way."""
    log = Path(child.log.name)
    stalls = lambda: log.read_text().count("injected fault at send.stall")  # noqa: E731
    eventually(lambda: stalls() >= sends, LOAD_S, f"{sends} sends stalled mid-way")
    assert stalls() == sends


def test_a_producer_dying_mid_transfer_fails_every_consumer_ranks_load(tp_instances, eventually):
    """A TP-1 producer sending to both ranks of a TP-2 consumer stops mid-transfer (its body's
    writes out) and is killed there: each consumer rank reports the load failed, its blocks in
    load_errors (vLLM recomputes them), within the load deadline; no rank hangs."""
    instances, boots = tp_instances
    producer, consumer = instances["stall"], instances["c2"]
    producer.step(sends=[{"req_id": "p81", "room": 81, "num_tokens": 100, "blocks": [3, 4]}])
    t0 = time.monotonic()
    load = {"req_id": "c81", "remote": _remote(81, boots["stall"], 100), "first": 0, "count": 100, "blocks": [5, 6]}
    consumer.step(loads=[load])
    _stalled(eventually, producer.ranks[0], 2)  # both consumer ranks' sends are mid-way
    producer.ranks[0].kill()
    got = consumer.wait(LOAD_S + 5)
    assert [(a["recving"], a["errors"]) for a in got] == [(["c81"], [5, 6])] * 2
    assert time.monotonic() - t0 <= LOAD_S + 1.0


def test_a_producer_rank_dying_mid_transfer_fails_the_load_its_peer_rank_lets_go(tp_instances, eventually):
    """TP 2 -> 1: producer rank 0 sends its heads, rank 1 stops mid-transfer and is killed: the
    consumer reports the load failed, its blocks in load_errors, within the load deadline (its
    other share landed, but half the heads did not), and rank 0 frees the room (it served the
    one consumer rank that needs its heads)."""
    instances, boots = tp_instances
    producer, consumer = instances["stall2"], instances["c1"]
    producer.step(sends=[{"req_id": "p82", "room": 82, "num_tokens": 100, "blocks": [3, 4, 5, 6]}])
    t0 = time.monotonic()
    load = {
        "req_id": "c82",
        "remote": _remote(82, boots["stall2"], 100),
        "first": 0,
        "count": 100,
        "blocks": [7, 8, 9, 10],
    }
    consumer.step(loads=[load])
    _stalled(eventually, producer.ranks[1], 1)
    assert producer.ranks[0].wait(LOAD_S)["sending"] == ["p82"]
    producer.ranks[1].kill()
    [got] = consumer.wait(LOAD_S + 5)
    assert (got["recving"], got["errors"]) == (["c82"], [7, 8, 9, 10])
    assert time.monotonic() - t0 <= LOAD_S + 1.0


# ---- Gemma3 (a sliding-window and a full-attention KV cache group) on vLLM's own allocation:
# other TP and block sizes pair by token within each group --------------------------------------

GEMMA_GROUPS = {"model.layers.0.self_attn.attn": 0, "model.layers.1.self_attn.attn": 1}  # layer -> its group
GEMMA_HEADS = 2  # the tiny Gemma3's KV heads (tiny_models.build_tiny_gemma3)
# vLLM's element (worker_child.vllm_config's float32) as bits: a dump's tensors are bytes (one
# storage), and the CPU kernels' K is dim-major by element, not by byte (_cell)
VLLM_ELEMENT = torch.int32


def _vllm_spec(role: str, seed: int, tp: tuple[int, int], bs: int, **extra) -> dict:
    extra.update(test_tp=list(tp), test_block_size=bs)
    if role != "kv_producer":
        extra.update(load_s=LOAD_S, dead_after_s=DEAD_S, quarantine_s=QUARANTINE_S)
    return {"role": role, "layout": "vllm", "seed": seed, "extra": extra}


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3, tmp_path_factory):
    """Producers TP 1 and TP 2 (blocks of 32); consumers TP 1 (32), TP 1 (64) and TP 2 (32): one
    process per side, a worker per rank (a TP-2 producer's rank 0 starts first: it runs the
    bootstrap), each over the KV cache vLLM's own grouping and allocation make of the tiny
    Gemma3 at its block size and TP (worker_child.vllm_caches).
    -> ({instance: [its ranks' workers]}, {producer instance: bootstrap})."""
    boots = {"p1": f"tcp://127.0.0.1:{_free_port()}", "p2": f"tcp://127.0.0.1:{_free_port()}"}
    producers = {
        "p1": _vllm_spec("kv_producer", 90, (1, 0), 32, bootstrap=boots["p1"]),
        "p2-0": _vllm_spec("kv_producer", 91, (2, 0), 32, bootstrap=boots["p2"]),
        "p2-1": _vllm_spec("kv_producer", 92, (2, 1), 32, bootstrap=boots["p2"]),
    }
    consumers = {
        "c1": _vllm_spec("kv_consumer", 93, (1, 0), 32),
        "c64": _vllm_spec("kv_consumer", 94, (1, 0), 64),
        "c2-0": _vllm_spec("kv_consumer", 95, (2, 0), 32),
        "c2-1": _vllm_spec("kv_consumer", 96, (2, 1), 32),
    }
    p, c = _start(tiny_gemma3, tmp_path_factory.mktemp("gemma3"), producers, consumers, num_blocks=48)
    try:
        instances = {}
        for child, specs in ((p, producers), (c, consumers)):
            for w in specs:
                instances.setdefault(w.split("-")[0], []).append(Worker(child, w))
        yield instances, boots
    finally:
        c.close()
        p.close()


def _groups_transfer(started, tmp_path, room: int, producer: str, consumer: str, src, dst, num_tokens=100):
    """Every rank of `producer` holds `src` (per group) for `num_tokens`; every rank of
    `consumer` loads all of them into `dst`, and each reports it loaded. -> (producer ranks'
    tensors, consumer ranks' before and after)."""
    instances, boots = started[:2]
    ps, cs = instances[producer], instances[consumer]
    before = [w.dump(tmp_path / f"before-{w.name}.pt") for w in cs]
    for w in ps:
        w.step(sends=[{"req_id": f"p{room}", "room": room, "num_tokens": num_tokens, "blocks": src}])
    load = {"req_id": f"c{room}", "remote": _remote(room, boots[producer], num_tokens), "first": 0, "count": num_tokens}
    for w in cs:
        w.step(loads=[{**load, "blocks": dst}])
    got = [w.wait(LOAD_S + 5) for w in cs]
    assert [(a["recving"], a["errors"], a["failed"]) for a in got] == [([f"c{room}"], [], [])] * len(cs)
    for w in ps:  # every producer rank's blocks may be freed now
        assert w.wait(10.0)["sending"] == [f"p{room}"]
    src_t = [w.dump(tmp_path / f"src-{w.name}.pt") for w in ps]
    return src_t, before, [w.dump(tmp_path / f"after-{w.name}.pt") for w in cs]


def _want_by_group(src_t, before, src, dst, bs: tuple[int, int], first: list[int], layers=None, n=100):
    """Each consumer rank's tensors as they must end: in each attention group's `layers`
    (layer -> group), every position from first[group] to n, every head (numbered across
    ranks), K and V, from the producer rank holding it, at that group's blocks on either side
    (a group's block list covers the prompt's last blocks); every other byte as before (the
    layers' views share one storage, as vLLM's do: a block is one group's at a time)."""
    p_heads, c_heads = GEMMA_HEADS // len(src_t), GEMMA_HEADS // len(before)
    for name, g in (layers or GEMMA_GROUPS).items():  # `before` changed in place: views of one storage
        dst_first = -(-n // bs[1]) - len(dst[g])  # the first block the consumer's list covers
        src_e, dst_e = [t[name].view(VLLM_ELEMENT) for t in src_t], [t[name].view(VLLM_ELEMENT) for t in before]
        for p in range(first[g], n):
            s, d = src[g][p // bs[0]], dst[g][p // bs[1] - dst_first]
            for h in range(GEMMA_HEADS):
                for kv in (0, 1):  # a copy moves the bits as they are (NaNs too)
                    value = _cell(src_e[h // p_heads], kv, s, p % bs[0])[h % p_heads]
                    _cell(dst_e[h // c_heads], kv, d, p % bs[1])[h % c_heads] = value
    return [{name: t.view(torch.uint8) for name, t in rank.items()} for rank in before]  # bytes: NaNs compare


@pytest.mark.parametrize(
    "room,producer,consumer,dst,bs",
    [
        (101, "p1", "c2", [[10, 11, 12], [1, 2, 13, 14]], (32, 32)),
        (102, "p2", "c1", [[10, 11, 12], [1, 2, 13, 14]], (32, 32)),
        (103, "p1", "c64", [[10, 11], [1, 2]], (32, 64)),
    ],
    ids=["tp1-to-tp2", "tp2-to-tp1", "blocks-32-to-64"],
)
def test_gemma3_groups_pair_by_token_across_tp_and_block_sizes(gemma3, tmp_path, room, producer, consumer, dst, bs):
    """A sliding-window group (window 64) and a full-attention group, on vLLM's own CPU
    allocation (the two layers' views share one storage): the producer holds 100 tokens, its
    window group's first block already null (left the window). The full group's 100 tokens and
    the window group's tokens the producer still holds (32-100) land in the consumer's blocks
    of that group, every head from the rank holding it, byte-equal; every other byte of the
    consumer's cache (its other blocks, the window block's positions 0-31 at block size 64) is
    untouched."""
    src = [[0, 3, 4, 5], [6, 7, 8, 9]]  # per group: window, full (vLLM's group order)
    src_t, before, after = _groups_transfer(gemma3, tmp_path, room, producer, consumer, src, dst)
    want = _want_by_group(src_t, before, src, dst, bs, first=[32, 0])
    for rank, (w, a) in enumerate(zip(want, after)):
        for name in GEMMA_GROUPS:
            for b in range(a[name].shape[0]):
                assert torch.equal(a[name][b].view(torch.uint8), w[name][b]), f"consumer rank {rank}, {name}, block {b}"


# ---- Qwen3-Next (a gated-delta-net layer's state and a full-attention layer in one page pool)
# on vLLM's own allocation: TP resharding of the state's slices -------------------------------

QWEN_ATTENTION, QWEN_STATE = "model.layers.1.self_attn.attn", "model.layers.0.linear_attn"
QWEN_BLOCK = 160  # vLLM raises the tiny Qwen3-Next's block size to fit its state in a page
GDN = {"k_heads": 2, "v_heads": 2, "dim": 128, "width": 3}  # the tiny Qwen3-Next's (tiny_models)


@pytest.fixture(scope="module", params=["SD", "DS"])
def qwen3_next(request, tiny_qwen3_next, tmp_path_factory):
    """Producers TP 1 and TP 2, consumers TP 1 and TP 2, blocks of 160 (as vLLM picks for the
    tiny Qwen3-Next), and a TP-1 consumer of blocks of 320: one process per side, a worker per
    rank, over vLLM's own grouping and allocation of its KV cache (worker_child.vllm_caches), in
    either conv state layout vLLM keeps (VLLM_SSM_CONV_STATE_LAYOUT: SD unless NIXL is configured,
    then DS; vLLM's CPU platform sets it in the process that configures it, so it is pinned here,
    never inherited). -> ({instance: [workers]}, {producer: bootstrap}, conv layout)."""
    boots = {"p1": f"tcp://127.0.0.1:{_free_port()}", "p2": f"tcp://127.0.0.1:{_free_port()}"}
    producers = {
        "p1": _vllm_spec("kv_producer", 110, (1, 0), QWEN_BLOCK, bootstrap=boots["p1"]),
        "p2-0": _vllm_spec("kv_producer", 111, (2, 0), QWEN_BLOCK, bootstrap=boots["p2"]),
        "p2-1": _vllm_spec("kv_producer", 112, (2, 1), QWEN_BLOCK, bootstrap=boots["p2"]),
    }
    consumers = {
        "c1": _vllm_spec("kv_consumer", 113, (1, 0), QWEN_BLOCK),
        "c320": _vllm_spec("kv_consumer", 116, (1, 0), 2 * QWEN_BLOCK),
        "c2-0": _vllm_spec("kv_consumer", 114, (2, 0), QWEN_BLOCK),
        "c2-1": _vllm_spec("kv_consumer", 115, (2, 1), QWEN_BLOCK),
    }
    layout, logs = request.param, tmp_path_factory.mktemp("qwen3-next")
    env = {"VLLM_SSM_CONV_STATE_LAYOUT": layout}
    p, c = _start(tiny_qwen3_next, logs, producers, consumers, num_blocks=24, env=env)
    try:
        instances = {}
        for child, specs in ((p, producers), (c, consumers)):
            for w in specs:
                instances.setdefault(w.split("-")[0], []).append(Worker(child, w))
        yield instances, boots, layout
    finally:
        c.close()
        p.close()


def _gdn(t: torch.Tensor, slot: int, tp: int, layout: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A rank's state in page `slot` as vLLM's GDN layer keeps it (int32 views: bit-exact):
    the conv state (SD: [width, q | k | v channels]; DS: [channels, width], seen here
    transposed) split into its q, k and v sections, and the SSM state [value heads, dim, dim]."""
    kh, vh, d, w = GDN["k_heads"] // tp, GDN["v_heads"] // tp, GDN["dim"], GDN["width"]
    raw = t[slot, 0, 0].view(torch.uint8)
    flat = raw[: w * (2 * kh + vh) * d * 4].view(torch.int32)
    conv = flat.view(w, -1) if layout == "SD" else flat.view(-1, w).t()
    ssm = raw[conv.numel() * 4 : conv.numel() * 4 + vh * d * d * 4].view(torch.int32).view(vh, d, d)
    return [conv[:, : kh * d], conv[:, kh * d : 2 * kh * d], conv[:, 2 * kh * d :]], ssm


def _want_state(src_t, want, src_slot: int, dst_slot: int, layout: str) -> None:
    """Each consumer rank's state slot as it must end (in place in `want`): every q, k and v
    channel of each conv column and every value head of the SSM state, from the producer rank
    holding it, at this rank's place; the page's padding as before."""
    states = [_gdn(t[QWEN_STATE], src_slot, len(src_t), layout) for t in src_t]
    whole = [torch.cat([s[0][i] for s in states], dim=1) for i in range(3)], torch.cat([s[1] for s in states])
    for rank, w in enumerate(want):
        sections, ssm = _gdn(w[QWEN_STATE], dst_slot, len(want), layout)
        for mine, glob in zip(sections, whole[0]):
            n = mine.shape[1]
            mine.copy_(glob[:, rank * n : (rank + 1) * n])
        ssm.copy_(whole[1][rank * ssm.shape[0] : (rank + 1) * ssm.shape[0]])


@pytest.mark.parametrize(
    "room,producer,consumer", [(121, "p1", "c2"), (122, "p2", "c1")], ids=["tp1-to-tp2", "tp2-to-tp1"]
)
def test_qwen3_next_state_and_attention_reshard_across_tp(qwen3_next, tmp_path, room, producer, consumer):
    """A gated-delta-net state slot and a full-attention group in one page pool (vLLM's own
    allocation: the state padded to the page): TP 1 -> 2 and 2 -> 1 at equal block sizes. Each
    consumer rank's slot gets its share of the state (a rank's slice of a page is not one byte
    range: each conv column's q, k and v channels, the SSM state's value heads) and its heads of
    the 300 tokens' K and V, byte-equal; every other byte (the slot page's padding, other
    pages) untouched; in either conv state layout (the fixture's)."""
    src, dst = [[5], [3, 4]], [[9], [2, 10]]  # per group: state slot, full (vLLM's group order)
    src_t, before, after = _groups_transfer(qwen3_next, tmp_path, room, producer, consumer, src, dst, 300)
    want = _want_by_group(src_t, before, src, dst, (QWEN_BLOCK,) * 2, [0, 0], {QWEN_ATTENTION: 1}, n=300)
    _want_state(src_t, want, 5, 9, qwen3_next[2])
    for rank, (w, a) in enumerate(zip(want, after)):
        for b in range(a[QWEN_ATTENTION].shape[0]):
            assert torch.equal(a[QWEN_ATTENTION][b].view(torch.uint8), w[QWEN_ATTENTION][b]), (
                f"consumer rank {rank}, page {b}"
            )


def test_a_qwen3_next_consumer_of_another_block_size_at_equal_tp_is_refused_naming_why(qwen3_next):
    """Equal TP sizes, blocks of 160 into 320: the state has no buffer of its own (it moves as
    whole pages or TP slices), so the producer refuses the registration naming both sides and
    why, and the load fails by request at once (not by its deadline)."""
    instances, boots, _ = qwen3_next
    producer, consumer = instances["p1"][0], instances["c320"][0]
    producer.step(sends=[{"req_id": "p123", "room": 123, "num_tokens": 300, "blocks": [[5], [3, 4]]}])
    load = {"req_id": "c123", "remote": _remote(123, boots["p1"], 300), "first": 0, "count": 300}
    consumer.step(loads=[{**load, "blocks": [[9], [2]]}])
    got = consumer.wait(LOAD_S + 5)
    assert (got["recving"], got["errors"], got["failed"]) == (["c123"], [], ["c123"]) and got["waited"] < LOAD_S
    log = Path(consumer.child.log.name).read_text()
    assert "block size 160, TP 1 (sender) vs 320, TP 1 (receiver)" in log and "equal block sizes" in log, log[-3000:]
