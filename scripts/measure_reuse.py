"""Is the model engine's KV of a prefix the same bits however it was computed? (issue 39)

For each family, positions [0, n1) of every layer's cache, computed as
    batch    one forward over the n1 tokens
    longer   one forward over n2 > n1 tokens (the same first n1)          length invariance
    steps    a batch of m < n1 tokens, then one decode step per token       a decode's KV
    chunk    a batch of m tokens, then one forward over the other n1 - m    chunked prefill
    chunks   forward passes of C tokens (C = 1: decode steps), n1 vs n2 tokens: positions
             [0, n1 // C * C) (whole chunks), the only shapes that do not depend on the length
and each compared bitwise with `longer` (the colocated run of a longer prompt), per component
(full / SWA K,V; MLA latent + rope key; NSA indexer keys). Run on CPU:

    PYTHONPATH=. .venv/bin/python scripts/measure_reuse.py [preset ...]
"""

import sys

import torch

from disagg.engine.model.engine import TransformersEngine

PRESETS = (
    "tiny-model-gpt-oss",
    "tiny-model-qwen3-next",
    "tiny-model-nemotron-h",
    "tiny-model-deepseek-v32",
    "tiny-model-deepseek-v3",
    "tiny-model-gemma3",
    "tiny-model-bamba",
)


def rows(cache, n1: int) -> dict:
    """{layer:component: (first position, tensor of positions [first, n1))}; SWA layers keep
    only their window, so `first` may be above 0."""
    out = {}
    for i, cl in enumerate(cache.layers):
        keys = getattr(cl, "keys", None)
        if keys is None or not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            continue
        total = getattr(cl, "cumulative_length", None)
        first = total - keys.shape[-2] if total is not None else 0
        kind = "swa" if total is not None else "kv"
        if first >= n1:
            continue
        sl = slice(0, n1 - first)
        out[f"{i}:{kind}.k"] = (first, keys[..., sl, :])
        out[f"{i}:{kind}.v"] = (first, cl.values[..., sl, :])
        ik = getattr(cl, "indexer_keys", None)
        if isinstance(ik, torch.Tensor) and ik.numel():
            out[f"{i}:nsa.key"] = (0, ik[:, :n1])
    return out


def run(engine, ids, past=None):
    ids = torch.as_tensor(ids).view(1, -1)
    cache = past if past is not None else engine._cache()
    with torch.no_grad():
        out = engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


def compare(want: dict, got: dict) -> str:
    """Over the positions both hold; "exact" where every bit is equal."""
    diffs, seen = {}, 0
    for k in want.keys() & got.keys():
        (a0, a), (b0, b) = want[k], got[k]
        lo = max(a0, b0)
        a, b = a[..., lo - a0 :, :], b[..., lo - b0 :, :]
        hi = min(a.shape[-2], b.shape[-2])
        if hi <= 0:
            continue
        seen += 1
        a, b = a[..., :hi, :], b[..., :hi, :]
        if not torch.equal(a, b):
            diffs[k] = float((a - b).abs().max())
    if not diffs:
        return f"exact ({seen} tensors)"
    return f"DIFFER in {len(diffs)}/{seen} ({', '.join(list(diffs)[:4])}; max {max(diffs.values()):.2g})"


def chunked(engine, ids, size: int):
    """The prompt in forward passes of `size` tokens at positions that are multiples of it."""
    cache = None
    for s in range(0, len(ids), size):
        _, cache = run(engine, ids[s : s + size], cache)
    return cache


def measure(preset: str, n1: int = 27, n2s=(29, 40, 97), m: int = 12, chunks=(1, 8, 16)) -> None:
    engine = TransformersEngine(preset)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, engine.vocab_size, (max(n2s),), generator=g)
    _, c1 = run(engine, ids[:n1])
    base = rows(c1, n1)
    print(f"{preset}: components {sorted({k.split(':')[1].split('[')[0] for k in base})}")
    for n2 in n2s:
        _, c2 = run(engine, ids[:n2])
        print(f"  batch {n1} vs batch {n2}: {compare(rows(c2, n1), base)}")
    _, cs = run(engine, ids[:m])
    for t in range(m, n1):
        _, cs = run(engine, ids[t : t + 1], cs)
    print(f"  batch {m} + {n1 - m} decode steps vs batch {n1}: {compare(base, rows(cs, n1))}")
    _, cc = run(engine, ids[:m])
    _, cc = run(engine, ids[m:n1], cc)
    print(f"  batch {m} + chunk of {n1 - m} vs batch {n1}: {compare(base, rows(cc, n1))}")
    for size in chunks:
        whole = n1 // size * size
        want = rows(chunked(engine, ids[:n1], size), whole)
        for n2 in n2s:
            got = rows(chunked(engine, ids[:n2], size), whole)
            print(f"  chunks of {size}: {n1} vs {n2} tokens, positions [0, {whole}): {compare(want, got)}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for p in sys.argv[1:] or PRESETS:
        measure(p)
