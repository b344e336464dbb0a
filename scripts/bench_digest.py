#!/usr/bin/env python3
"""What the byte digest costs (issue 35, item 9): in one process, per preset and prompt
length, a request's path with and without it, side by side, alternating, median of --reps:

    prefill   the engine computes the prompt's KV into a pool        (off)
              + kvpool.digest.compute over what it wrote             (on: before TransferDone)
    decode    the engine's verify + generate --max-new-tokens         (off)
              + the digest of what it holds, compared with prefill's  (on: before generating)

No transfer: decode reads prefill's pool (the digest is the same pass whatever moved the
bytes). Model presets run the model engine; geometry presets the stand-in.

    # the CPU figures in the commit that added the digest
    .venv/bin/python scripts/bench_digest.py --presets tiny-model-qwen3-next,tiny-model-gpt-oss \\
        --prompt-lens 64,512 --reps 3
"""

import argparse
import statistics
import time

import numpy as np
import torch

from disagg.control import digests
from disagg.engine import registry
from disagg.engine.model.families import FAMILIES
from kvpool import HybridPool, PoolConfig, digest, get_preset


def _timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def one(eng, pool: HybridPool, tokens: np.ndarray, new: int, device: str) -> dict:
    """ms of each step of one request, prefill and decode on `pool`."""
    req = pool.alloc_request(len(tokens), grow_to=len(tokens) + new)
    out = {"prefill": _timed(lambda: eng.prefill(pool, req, tokens, room=1), device)}
    sums = {}
    out["digest_prefill"] = _timed(lambda: sums.update(digest.compute(pool, req, len(tokens))), device)
    tp = (1, 0)

    def check() -> None:
        wire = digests.for_destination(pool.config.model, sums, tp, tp)
        want = digests.expected(pool.config.model, tp, [wire])
        digests.check(pool.config.model, tp, digest.compute(pool, req, len(tokens)), want)

    out["digest_decode"] = _timed(check, device)
    out["decode"] = _timed(lambda: (eng.verify(pool, req, tokens, 1), eng.decode(pool, req, tokens, new)), device)
    pool.free_request(req)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny-model-qwen3-next,tiny-model-gpt-oss")
    ap.add_argument("--prompt-lens", default="64,512")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for preset in args.presets.split(","):
        eng = registry.create("auto", preset, args.device)
        lens = [int(n) for n in args.prompt_lens.split(",")]
        spec = eng.spec or get_preset(preset)
        page = FAMILIES[preset].page_size if preset in FAMILIES else 16
        pool = HybridPool(
            PoolConfig(
                spec, page, max_tokens=2 * (max(lens) + args.max_new_tokens) + 64, max_requests=2, device=args.device
            )
        )
        vocab = eng.vocab_size or 50000
        for n in lens:
            tokens = np.random.default_rng(n).integers(0, vocab, n)
            one(eng, pool, tokens, args.max_new_tokens, args.device)  # warm-up
            runs = [one(eng, pool, tokens, args.max_new_tokens, args.device) for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"{preset:24s} {n:6d} tokens: prefill {med['prefill']:8.1f} ms + digest {med['digest_prefill']:6.2f} ms"
                f" ({100 * med['digest_prefill'] / med['prefill']:5.1f}%); decode {med['decode']:8.1f} ms + "
                f"digest and compare {med['digest_decode']:6.2f} ms "
                f"({100 * med['digest_decode'] / med['decode']:5.1f}%)",
                flush=True,
            )


if __name__ == "__main__":
    main()
