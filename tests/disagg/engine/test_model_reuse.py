"""Decode's and prefill's prefix caches with the model engine, in one process: a conversation of three turns
(each prompt the previous one, its answer and a few new tokens) takes the cached prefix, and
the bytes decode reuses are the bytes prefill computes for the new prompt (a full copy of
prefill's request leaves every shared page as it was); tokens and logits equal the colocated
run's bit for bit. Prefill computes prompts in passes of whole chunks (engine/model/reuse.py);
one pass, or caching decode steps' KV, is not exact, and families whose code cannot continue
a cache with a chunk run without reuse. Prefill resumes a prompt after its cached whole chunks
with the bits of a whole prefill (full attention, SWA, MLA + NSA); with state layers it
computes every prompt whole (it keeps no snapshot of the state), and says so.

Which families reuse depends on the device (the engine says: `exact_reuse`, `reuse_note`),
and REUSE lists it; every test asserts the engine's report first, and exactness only where it
reuses."""

import numpy as np
import pytest
import torch

from disagg.engine import registry
from disagg.engine.model.engine import TransformersEngine
from disagg.engine.model.reuse import Passes
from kvpool import HybridPool, PoolConfig
from kvpool.cache.prefix import PrefixCache
from kvpool.positions import backed, kept_positions, paged_components, token_items
from tests.kvpool.helpers import copy_request

FAMILIES = ["tiny-model-gpt-oss", "tiny-model-qwen3-next", "tiny-model-nemotron-h", "tiny-model-deepseek-v32"]
ENGINES: dict = {}

# What the model engine does with a family, where that is not passes of 8 tokens with exact
# reuse ("chunked"): "one pass" (its model code fails to continue a cache with 8-token passes: no
# reuse, said at start). The same on CPU and CUDA with the transformers the engine is tested with
# (families.TESTED_TRANSFORMERS; the CUDA-only rows once seen came from the GPU machine's 5.17).
REUSE = {
    ("tiny-model-jamba", None): "one pass",  # their code ignores the cache's state for a multi-token
    ("tiny-model-bamba", None): "one pass",  # input (logits off by 0.8-3 of ~15)
}


def expected(preset: str, device: str) -> str:
    return REUSE.get((preset, device.split(":")[0]), REUSE.get((preset, None), "chunked"))


def engine(preset: str, device: str):
    """The family's engine, after asserting that it reuses as REUSE says for this device."""
    want = expected(preset, device)
    if (preset, device) not in ENGINES:
        ENGINES[preset, device] = registry.create("model", preset, device)
    eng = ENGINES[preset, device]
    if want == "one pass":
        assert not eng.exact_reuse and eng.passes.chunk == 0 and "one pass" in eng.reuse_note, eng.reuse_note
    else:
        assert eng.exact_reuse and eng.passes.chunk == 8, eng.reuse_note
    return eng


def pool(eng, page_size: int = 4) -> HybridPool:
    return HybridPool(PoolConfig(eng.spec, page_size, max_tokens=512, max_requests=4, device=eng.device.type))


def snapshot(p: HybridPool) -> dict:
    return {c: [buf.clone() for buf in q.storage.buffers] for c, q in p.pools.items()}


def changed_prefix(p: HybridPool, before: dict, kv, prefix_len: int) -> list[str]:
    """The paged components whose items holding positions [0, prefix_len) changed since `before`."""
    out = []
    for c in paged_components(p):
        items, _ = token_items(p, c, kv, np.arange(prefix_len))
        items = np.unique(items[backed(items)])
        for old, new in zip(before[c], p.pools[c].storage.buffers):
            if not torch.equal(old[items], new[items]):
                out.append(c.value)
    return out


def turn(eng, prefill: HybridPool, cache: PrefixCache, prompt: np.ndarray, new: int, keep) -> tuple:
    """One request: decode admits on the cache, prefill computes the whole prompt, a full copy
    stands for the transfer; -> (prefix_len, components whose reused bytes the copy changed,
    check, output)."""
    kv, hit = cache.admit(prompt, grow_to=len(prompt) + new)
    preq = prefill.alloc_request(len(prompt))
    eng.prefill(prefill, preq, prompt, 5)
    before = snapshot(cache.pool)
    copy_request(prefill, preq, cache.pool, kv)
    prefill.free_request(preq)
    changed = changed_prefix(cache.pool, before, kv, hit.prefix_len)
    out = eng.decode(cache.pool, kv, prompt, max_new_tokens=new)
    check = eng.check(prompt, out)
    held = np.concatenate([prompt, np.asarray(out.tokens[: kv.num_tokens - len(prompt)], dtype=np.int64)])
    cache.release(kv, hit, held[: keep(len(prompt), len(held))])
    return hit.prefix_len, changed, check, out


def conversation(eng, keep, turns: int = 3, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    prefill, cache = pool(eng), PrefixCache(pool(eng))
    prompt, results = rng.integers(0, eng.vocab_size, 21), []
    for _ in range(turns):
        prefix, changed, check, out = turn(eng, prefill, cache, prompt, 7, keep)
        results.append((prefix, changed, check))
        prompt = np.concatenate([prompt, out.tokens, rng.integers(0, eng.vocab_size, 5)])
    return results


@pytest.mark.parametrize("preset", FAMILIES)
def test_three_turns_reuse_exactly_what_prefill_computes(preset, device):
    eng = engine(preset, device)
    if not eng.exact_reuse:  # (engine() asserted that, as REUSE says)
        return
    results = conversation(eng, eng.reusable)
    assert [r[0] for r in results] == [0, 16, 32], results  # whole 8-token chunks of the last prompt
    for prefix, changed, check in results:
        assert not changed, (prefix, changed)
        assert check["token_match"] and check["logits_match"] and check["shard_match"], check


@pytest.mark.parametrize("preset", ["tiny-model-gpt-oss", "tiny-model-nemotron-h"])
def test_one_pass_prefill_or_decode_steps_kv_would_not_be_exact(preset, device):
    """What the chunked passes fix: a one-pass prefill that keeps all it holds (what the cache
    did before) reuses bytes that differ from the new prompt's prefill."""
    eng = TransformersEngine(preset, device, prefill_chunk=0)
    assert not eng.exact_reuse and "one forward pass" in eng.reuse_note
    results = conversation(eng, lambda prompt_len, held: held)
    assert results[1][0] > 0 and results[1][1], results


def test_every_position_is_reusable_with_one_token_passes(device):
    """Passes of one token are decode steps: decode may keep the generated tokens' KV too."""
    eng = TransformersEngine("tiny-model-gpt-oss", device, prefill_chunk=1)
    assert eng.exact_reuse and eng.reusable(21, 27) == 27
    results = conversation(eng, eng.reusable)
    assert [r[0] for r in results] == [0, 24, 36], results  # whole pages of all the last request held
    for prefix, changed, check in results:
        assert not changed and check["token_match"] and check["logits_match"], (prefix, changed, check)


@pytest.mark.parametrize("preset", ["tiny-model-jamba", "tiny-model-bamba"])
def test_families_that_cannot_continue_a_cache_run_without_reuse(preset, device):
    """Their model code ignores the cache's state for a multi-token input: chunked passes
    would compute another function, so prompts run in one pass and decode keeps no cache."""
    eng = engine(preset, device)
    assert eng.passes == Passes(0, eng.reuse_note) and not eng.exact_reuse
    assert "does not continue a cache" in eng.reuse_note and eng.reusable(40, 45) == 0


def positions_bytes(p: HybridPool, kv, n: int) -> dict:
    """The bytes of what a receiver keeps of a request of n tokens (SWA: the window; every
    position of the others: a pass leaves the SWA positions its cache drops unwritten)."""
    out = {}
    for c in paged_components(p):
        positions = kept_positions(p, c, n)
        items, slots = token_items(p, c, kv, positions)
        for pl in p.pools[c].storage.packed.placements:
            view = p.layer_view(pl.segment.layer, pl.segment.part)[items, slots]
            out[c.value, pl.segment.layer, pl.segment.part] = view.contiguous().view(torch.uint8).cpu()
    return out


@pytest.mark.parametrize("page", [4, 16])
@pytest.mark.parametrize("preset", ["tiny-model-gpt-oss", "tiny-model-deepseek-v32"])
def test_a_prefill_hit_gives_the_bits_of_a_whole_prefill(preset, page, device):
    """Prefill's prefix cache (as the prefill server builds it): the second prompt resumes
    after the first one's whole chunks; its KV is bitwise the KV of a whole prefill in a fresh
    pool, its first token the same, and a decode from it gives the colocated run's tokens and
    logits bit for bit. Where the engine runs one pass on this device, it says prefill reuses
    nothing."""
    eng = engine(preset, device)
    p, fresh = pool(eng, page), pool(eng, page)
    reuse = eng.prefill_reuse(p)
    if not eng.exact_reuse:  # (engine() asserted that, as REUSE says)
        assert reuse.align == 0 and "computes every prompt whole" in reuse.note, reuse
        return
    assert reuse.align == 8, reuse
    cache = PrefixCache(p, window_only=False, align=reuse.align)
    rng = np.random.default_rng(page)
    first = rng.integers(0, eng.vocab_size, 37)
    kv, hit = cache.admit(first)
    eng.prefill(p, kv, first, 1, cached=hit.prefix_len)
    cache.release(kv, hit, first[: eng.reusable(len(first), len(first))])  # 32: its whole chunks
    second = np.concatenate([first, rng.integers(0, eng.vocab_size, 30)])
    kv, hit = cache.admit(second)
    assert hit.prefix_len == 32, hit
    got = eng.prefill(p, kv, second, 2, cached=hit.prefix_len)
    whole = fresh.alloc_request(len(second))
    assert eng.prefill(fresh, whole, second, 2) == got
    want, have = positions_bytes(fresh, whole, len(second)), positions_bytes(p, kv, len(second))
    assert [k for k in want if not torch.equal(want[k], have[k])] == []
    dec = pool(eng, page)
    out = dec.alloc_request(len(second), swa_window_only=True, grow_to=len(second) + 4)
    copy_request(p, kv, dec, out)
    check = eng.check(second, eng.decode(dec, out, second, max_new_tokens=4))
    assert check["token_match"] and check["logits_match"] and check["shard_match"], check
    cache.release(kv, hit, None)


@pytest.mark.parametrize("preset", ["tiny-model-qwen3-next", "tiny-model-nemotron-h"])
def test_prefill_computes_a_state_familys_prompts_whole(preset, device):
    """State layers (GDN, Mamba2) would resume from the state at the cached prefix's end, and
    prefill keeps no snapshot of it: prefill's prefix cache is off for them, and says why
    (decode's still reuses: the state comes whole from prefill)."""
    eng = engine(preset, device)
    p = pool(eng)
    reuse = eng.prefill_reuse(p)
    assert reuse.align == 0 and "state layers" in reuse.note and "snapshot" in reuse.note, reuse
    with pytest.raises(ValueError, match="cannot resume"):
        eng.prefill(p, p.alloc_request(20), np.arange(20), 1, cached=8)


def test_prefill_on_a_tp_shard_computes_every_prompt_whole(device):
    """A TP shard's pool holds some K/V heads; resuming needs them all."""
    eng = engine("tiny-model-gpt-oss", device)
    shard = HybridPool(PoolConfig(eng.spec, 4, tp_size=2, max_tokens=512, max_requests=4, device=eng.device.type))
    reuse = eng.prefill_reuse(shard)
    assert reuse.align == 0 and "TP shard" in reuse.note, reuse


def test_passes_and_what_they_let_decode_keep():
    p = Passes(8, "")
    assert p.spans(27) == [(0, 8), (8, 16), (16, 24), (24, 27)] and p.spans(16) == [(0, 8), (8, 16)]
    assert p.reusable(27, 33) == 24 and p.reusable(7, 12) == 0 and p.reusable(16, 16) == 16
    assert Passes(0, "").spans(27) == [(0, 27)] and Passes(0, "").reusable(27, 33) == 0
    assert Passes(1, "").reusable(27, 33) == 33
    assert p.spans(27, 16) == [(16, 24), (24, 27)] and p.spans(16, 16) == []


def test_a_model_that_raises_on_a_continued_cache_runs_in_one_pass_without_reuse():
    """Model code that raises when a pass continues a cache (deepseek-v32's on an H100 did, in
    transformers' cache concatenation) leaves the engine in one pass with no prefix cache and
    the reason, instead of failing the engine's start."""
    from disagg.engine.model.reuse import pin_passes

    def forward(tokens, cache):
        if cache:
            raise RuntimeError("Sizes of tensors must match except in dimension 2\nmore")
        return torch.ones(4), [len(tokens)]

    got = pin_passes(forward, list, 50, "tiny", 8)
    assert got.chunk == 0 and not got.exact, got
    assert "fails to continue a cache with 8-token passes (RuntimeError: Sizes of tensors must match" in got.note
