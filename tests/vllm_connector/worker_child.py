"""DisaggWorkers in a process of their own, driven over stdin/stdout (JSON lines), for the
two-process worker tests (test_worker.py). Not a test module. One process holds several
workers (each its own tensors, endpoint, Mooncake engine and control plane), so the tests of
several layouts and roles share one process per side: each process imports vLLM (seconds).

    python worker_child.py MODEL NUM_BLOCKS WORKERS_JSON
        WORKERS_JSON: {name: {"role": "kv_producer" | "kv_consumer" | "kv_both",
                              "layout": "cpu" | "cuda-style" | "gdn" | "swa" | "vllm", "seed": n,
                              "extra": kv_connector_extra_config}}
        (an extra's "test_block_size" and "test_tp" [size, rank] are taken out before the
        connector sees them: a side started with another --block-size, one rank of a TP
        instance whose other ranks run elsewhere; hybrid layouts keep blocks of 32; "vllm": the
        tensors vLLM's own grouping and allocation make of the model at that block size and TP)
    (every answer is one line "@@ " + JSON: vLLM logs to stdout too)
    -> {"ready": true} once every worker registered (a producer: its rank held at the bootstrap)
    <- {"op": "step", "worker": name, "sends": [...], "loads": [...], "releases": [...]}   -> {}
    <- {"op": "wait", "worker": name, "timeout": s, "poll": s (0.005)}
                                      -> {"sending", "recving", "errors", "failed", "figures", "waited"}:
                                         the first non-empty finished() (or empty ones at the
                                         timeout), the figures that came with it; finished()
                                         is asked every `poll` s (0: spinning between the
                                         calls, as vLLM's worker waits for its next step)
    <- {"op": "hops"}                 -> {"hops": [[ns, room, hop, thread], ...]}: disagg.vllm.hops'
                                         marks since the last ask (DISAGG_HOPS=1 in the
                                         environment), with "c.step" just before a step's
                                         load went to the worker and "c.finished" once
                                         finished() reported it
    <- {"op": "dump", "worker": name, "path": p}   -> {}: every layer's tensor (torch.save; views
                                                        of one storage stay so when loaded)
    <- {"op": "close"}                -> {} and exit
"""

import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

BLOCK_SIZE = 32


@functools.cache
def vllm_test_utils():
    """vLLM's tests/v1/kv_connector/unit/utils.py (create_vllm_config)."""
    path = Path(os.environ["DISAGG_VLLM_TESTS"]) / "tests" / "v1" / "kv_connector" / "unit" / "utils.py"
    spec = importlib.util.spec_from_file_location("vllm_kv_connector_test_utils", path)
    u = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(u)
    return u


def vllm_config(role: str, model: str, extra: dict, block_size: int = BLOCK_SIZE, tp: tuple[int, int] = (1, 0)):
    cfg = vllm_test_utils().create_vllm_config(
        model=model,
        block_size=block_size,
        kv_connector="DisaggConnector",
        kv_connector_module_path="disagg.vllm.connector",
        kv_role=role,
        kv_connector_extra_config=extra,
        dtype="float32",
    )
    cfg.parallel_config.tensor_parallel_size, cfg.parallel_config.rank = tp  # its KV heads: this rank's
    return cfg


def kv_caches(cfg, layout: str, seed: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """Random KV in vLLM's CPU layout ([blocks, kv heads, block size, 2 * head size], LBHNC) or
    a CUDA-style K/V-first one ([2, blocks, block size, kv heads, head size]), per layer."""
    m = cfg.model_config
    heads, head = m.get_num_kv_heads(cfg.parallel_config), m.get_head_size()
    bs = cfg.cache_config.block_size
    shape = (num_blocks, heads, bs, 2 * head) if layout == "cpu" else (2, num_blocks, bs, heads, head)
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=g)
        for i in range(m.get_num_layers(cfg.parallel_config))
    }


PAGE = 2 * BLOCK_SIZE * 128 * 4  # one attention block of vLLM's CPU layout: 2 KV heads of 64, float32
STATE_BYTES = 20_000  # a GDN layer's conv + SSM state, padded to a page


def hybrid_caches(layout: str, seed: int, num_blocks: int):
    """(tensors, KVGroups, raw pages) as vLLM hands over a hybrid model's KV cache on CPU (seen
    in register_kv_caches of a real server): every layer's tensor is a view of one page pool.
    "gdn" (Qwen3-Next): layer 0's state, an int8 [blocks, 1, 1, state bytes] view whose block
    stride is the page; layer 1's attention blocks [blocks, 2, 32, 128]. "swa" (Gemma3):
    layer 0 sliding window (64 tokens), layer 1 full attention, both attention views."""
    from disagg.vllm.groups import Group, Kind, KVGroups

    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks * PAGE,), dtype=torch.uint8, generator=g)
    attention = raw.view(torch.float32).view(num_blocks, 2, BLOCK_SIZE, 128)
    if layout == "gdn":
        state = torch.as_strided(
            raw.view(torch.int8), (num_blocks, 1, 1, STATE_BYTES), (PAGE, STATE_BYTES, STATE_BYTES, 1)
        )
        kv = KVGroups((Group(Kind.STATE, 512), Group(Kind.FULL, BLOCK_SIZE)), frozenset({"model.layers.0.linear_attn"}))
        return {"model.layers.0.linear_attn": state, "model.layers.1.self_attn.attn": attention}, kv, raw
    kv = KVGroups((Group(Kind.WINDOW, BLOCK_SIZE, 3), Group(Kind.FULL, BLOCK_SIZE)), frozenset())
    return {f"model.layers.{i}.self_attn.attn": attention for i in range(2)}, kv, raw


def layer_specs(cfg) -> dict:
    """Each KV cache layer's spec as the model's layers declare it on this rank (vLLM's
    get_kv_cache_spec, without building the model), by the checkpoint's layer_types: Gemma3's
    sliding-window and full attention layers, Qwen3-Next's gated-delta-net ones (their state's
    shapes and dtypes from vLLM's own calculators) and full attention."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    m = cfg.model_config
    hf = m.hf_text_config
    kw = dict(
        block_size=cfg.cache_config.block_size,
        num_kv_heads=m.get_num_kv_heads(cfg.parallel_config),
        head_size=m.get_head_size(),
        dtype=m.dtype,
    )
    out = {}
    for i, kind in enumerate(hf.layer_types):
        name = f"model.layers.{i}.self_attn.attn"
        if kind == "sliding_attention":
            out[name] = SlidingWindowSpec(sliding_window=hf.sliding_window, **kw)
        elif kind == "full_attention":
            out[name] = FullAttentionSpec(**kw)
        elif kind == "linear_attention":
            out[f"model.layers.{i}.linear_attn"] = gdn_spec(cfg)
        else:
            raise ValueError(f"layer {i}: {kind} has no spec here")
    return out


def gdn_spec(cfg):
    """A gated-delta-net layer's MambaSpec as vLLM's GDN layer declares it on this rank."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    hf, cc = cfg.model_config.hf_text_config, cfg.cache_config
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        cfg.parallel_config.tensor_parallel_size,
        hf.linear_num_key_heads,
        hf.linear_num_value_heads,
        hf.linear_key_head_dim,
        hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim,
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        cfg.model_config.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype
    )
    return MambaSpec(
        shapes=tuple(shapes),
        dtypes=dtypes,
        block_size=cc.block_size,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cc.mamba_cache_mode,
    )


def vllm_caches(cfg, seed: int, num_blocks: int):
    """(tensors, KVGroups) as a vLLM CPU worker hands them to register_kv_caches: vLLM's own
    KV cache groups and tensors (get_kv_cache_configs) and its allocation (allocate_kv_cache,
    in the CPU attention backend's layout), filled with random bytes; our KVGroups read off
    that config as the connector reads it (disagg.vllm.connector.kv_groups)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache

    from disagg.vllm.connector import kv_groups

    cfg.cache_config.num_gpu_blocks_override = num_blocks
    specs = layer_specs(cfg)
    [kc] = get_kv_cache_configs(cfg, [specs], [1 << 40])
    layout = CPUAttentionBackend.supported_kv_cache_layouts()[0]
    caches = allocate_kv_cache(kc, torch.device("cpu"), layout)
    raw = _raw(next(iter(caches.values())))
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return caches, kv_groups(kc, cfg.cache_config.block_size, cfg)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under a view, as flat bytes."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def step_meta(cmd: dict):
    from disagg.vllm.params import RemotePrefill
    from disagg.vllm.scheduler import Load, Release, Send, StepMeta

    def blocks(b):  # one KV cache group, or a list per group
        return tuple(tuple(x) for x in b) if b and isinstance(b[0], list) else (tuple(b),)

    return StepMeta(
        sends=[Send(s["req_id"], s["room"], s["num_tokens"], blocks(s["blocks"])) for s in cmd.get("sends", ())],
        loads=[
            Load(x["req_id"], RemotePrefill(**x["remote"]), x["first"], x["count"], blocks(x["blocks"]))
            for x in cmd.get("loads", ())
        ],
        releases=[Release(RemotePrefill(**x["remote"]), x["reason"], x.get("req_id")) for x in cmd.get("releases", ())],
    )


def busy(seconds: float) -> None:
    """Python work holding the GIL for `seconds`, as a vLLM step's own work does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def wait(worker, timeout: float, poll: float = 0.005, rooms: dict | None = None, step_s: float = 0.0) -> dict:
    """`rooms`: req_id -> room of the loads stepped (their "c.finished" hop is marked here);
    `step_s`: Python work between two finished() calls."""
    from disagg.vllm import hops

    t0 = time.monotonic()
    while True:
        sending, recving = worker.finished()
        for req_id in recving or ():
            hops.mark((rooms or {}).get(req_id, -1), "c.finished")
        if sending or recving or time.monotonic() - t0 >= timeout:
            return {
                "sending": sorted(sending or ()),
                "recving": sorted(recving or ()),
                "errors": sorted(worker.load_errors()),
                "failed": sorted(worker.failed_loads()),
                "figures": worker.figures(),
                "waited": time.monotonic() - t0,
            }
        busy(step_s)
        if poll:
            time.sleep(poll)
        else:  # as a vLLM worker's main thread waits for its next step: spinning, yielding the core
            os.sched_yield()


def say(answer: dict) -> None:
    print("@@ " + json.dumps(answer), flush=True)


def start(model: str, spec: dict, num_blocks: int):
    """One registered worker as `spec` says, and the tensors a dump saves."""
    from disagg.vllm.connector import kv_groups
    from disagg.vllm.worker import DisaggWorker

    extra = dict(spec["extra"])
    block_size, tp = extra.pop("test_block_size", BLOCK_SIZE), tuple(extra.pop("test_tp", (1, 0)))
    cfg = vllm_config(spec["role"], model, extra, block_size, tp)
    if spec["layout"] == "vllm":
        caches, kv = vllm_caches(cfg, spec["seed"], num_blocks)
        caches_out = {n: t.view(torch.uint8) for n, t in caches.items()}  # one storage, one dtype: saved once
    elif spec["layout"] in ("gdn", "swa"):
        caches, kv, raw = hybrid_caches(spec["layout"], spec["seed"], num_blocks)
        caches_out = {"pages": raw.view(num_blocks, PAGE)}
    else:
        caches, kv = kv_caches(cfg, spec["layout"], spec["seed"], num_blocks), None
        caches_out = caches
    worker = DisaggWorker.from_vllm(cfg, extra, kv_groups(None, block_size) if kv is None else kv)
    worker.register(caches)
    return worker, caches_out


def main() -> None:
    from disagg.vllm import hops

    model, num_blocks, specs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    workers = {name: start(model, spec, num_blocks) for name, spec in specs.items()}
    rooms: dict[str, int] = {}  # a load's req_id -> its room (for the hops)
    say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict = {}
        if cmd["op"] == "close":
            for worker, _ in workers.values():
                worker.close()
            say(out)
            return
        if cmd["op"] == "hops":
            say({"hops": hops.take()})
            continue
        worker, caches_out = workers[cmd["worker"]]
        if cmd["op"] == "step":
            for load in cmd.get("loads", ()):
                rooms[load["req_id"]] = load["remote"]["room"]
                hops.mark(load["remote"]["room"], "c.step")
            worker.step(step_meta(cmd))
        elif cmd["op"] == "wait":
            out = wait(worker, cmd["timeout"], cmd.get("poll", 0.005), rooms, cmd.get("step_s", 0.0))
        elif cmd["op"] == "dump":
            torch.save(caches_out, cmd["path"])
        say(out)


if __name__ == "__main__":
    main()
