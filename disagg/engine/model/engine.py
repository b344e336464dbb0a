"""The model engine: a tiny model of the preset's family, built from transformers' model code
with seeded random weights (the same seed on both sides: the same model), that produces and
consumes KV through the pools.

    prefill  forward passes over the prompt, `prefill_chunk` tokens each at positions that
             are multiples of it (0: one pass); as decoder layer i returns (a forward hook),
             the pass's positions and the state are copied into the request's pool items, and
             in the last pass on_layer(i); the argmax of the last logits goes into the AUX row
             as the first token
    decode   a fresh cache built from the pool alone (CacheIO.read_cache), then one token per
             forward pass; each step's new KV is written back into the pool, so the pool
             stays the truth (retract/restore works on it)
    TP > 1   one rank of an instance: prefill computes the whole model and writes the rank's
             shard (its K/V heads, conv channel groups, state heads; MLA and NSA whole);
             decode takes the rank's shard from the pool and every other unit from the
             prompt computed here, so a wrong byte of its shard that the model reads moves
             its logits off the colocated run's (tests/disagg/engine/test_model_engine_tp.py flips
             one in one rank's shard: that rank's check fails, the others' pass)
    check    the colocated run: the whole model over the prompt in this process (the same
             passes as prefill), greedy continuation; tokens and logits (bitwise) compared
             with decode's
    reuse    a pass of whole chunk k has the same shapes and inputs in any prompt that starts
             with the same (k+1) * chunk tokens, so its KV is the same bits; one pass over the
             whole prompt is not (its kernels' shapes, Mamba/GDN chunking and MoE groups follow
             the length: bits differ by ~1e-6), nor is a decode step's (reuse.py; measured by
             scripts/measure_reuse.py). Decode's prefix cache keeps what `reusable` says.

One lock serialises forward passes (one model, like a scheduler's single batch loop); the
forward hooks read the prefill that holds it.
"""

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from disagg.engine.base import (
    DecodeOutput,
    PrefillResult,
    PrefillReuse,
    check_aux,
    compare_tokens,
    prompt_digest,
    stop_if,
)
from disagg.engine.model import attention
from disagg.engine.model.cache_io import CacheIO
from disagg.engine.model.families import family, go_offline, hf_config
from disagg.engine.model.geometry import spec_from_cache
from disagg.engine.model.reuse import Passes, pin_passes
from disagg.engine.model.source import PLAIN_EAGER, ModelSource, config_hash, load_directory, weights_fingerprint
from disagg.errors import ConfigError
from kvpool import HybridPool, RequestKV

PROBE = (1, 2, 3)  # the prompt whose cache tells the pool geometry


class TransformersEngine:
    name = "model"
    byte_digest = True  # its outputs could hide a wrong byte: decode compares prefill's digest

    def __init__(
        self,
        preset: "str | ModelSource",
        device: str = "cpu",
        seed: int = 0,
        attn_chunk: int = attention.CHUNK,
        prefill_chunk: int | None = None,
    ):
        """preset: a family of ours, or a ModelSource (--model / --model-type); attn_chunk:
        queries per block of the eager attention (disagg.engine.model.attention);
        prefill_chunk: tokens per prefill pass (None: the family's; a ModelSource: 0, one pass)."""
        go_offline()
        from transformers import DynamicCache

        self._new_cache = DynamicCache
        impl = lambda chunked: attention.register(attn_chunk) if chunked else "eager"  # noqa: E731
        if isinstance(preset, ModelSource) and preset.path is not None:
            self.config, model = load_directory(preset, device, lambda t: impl(t not in PLAIN_EAGER))
            name, page_size, chunk = preset.name, preset.page_size, 0
        else:
            f = preset.family() if isinstance(preset, ModelSource) else family(preset)
            self.config, model = self._random(f, seed, impl(f.chunked_attention))
            name, page_size = f.preset, f.page_size
            chunk = f.prefill_chunk if isinstance(preset, str) else 0
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.preset = name
        self.vocab_size = int(self.config.vocab_size)
        self._lock = threading.Lock()
        self._layer_done: Callable[[int], None] | None = None
        decoder = self.model.base_model.layers
        for i, layer in enumerate(decoder):
            layer.register_forward_hook(lambda *_, i=i: self._layer_done and self._layer_done(i))
        try:
            _, probe = self._forward(np.array(PROBE), self._cache())
        except Exception as exc:  # the model code refuses our cache (e.g. a cache of linear layers only)
            raise ConfigError(
                f"{name}: the model's forward pass over a {len(PROBE)}-token probe with a "
                f"DynamicCache failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            ) from None
        if len(probe.layers) != len(decoder):
            raise ConfigError(f"{name}: {len(decoder)} decoder layers but {len(probe.layers)} cache layers")
        self.spec, self._states = spec_from_cache(name, probe, hasattr(self.config, "kv_lora_rank"), page_size, decoder)
        chunk = chunk if prefill_chunk is None else prefill_chunk
        self.passes: Passes = pin_passes(self._forward, self._cache, self.vocab_size, name, chunk)
        self.exact_reuse = self.passes.exact
        self.reuse_note = self.passes.note
        # what the other side checks at registration: the same model, not only the same geometry,
        # computing prompts in the same passes (decode caches and checks by its own)
        self.identity = {
            "config_hash": config_hash(self.config),
            "weights": weights_fingerprint(self.model),
            "prefill_chunk": self.passes.chunk,
        }

    @staticmethod
    def _random(f, seed: int, impl: str):
        """(config, model) of a family with seeded random weights (built on CPU from the seed:
        the same weights on any device)."""
        from transformers import AutoModelForCausalLM

        config = hf_config(f)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                return config, AutoModelForCausalLM.from_config(
                    config, attn_implementation=impl, dtype=getattr(torch, f.dtype)
                )
            except Exception as exc:  # e.g. a model type with no causal-LM class, a padding id past the vocabulary
                raise ConfigError(
                    f"{f.preset}: transformers cannot build it: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:300] if str(exc) else ''}"
                ) from None

    def _cache(self):
        return self._new_cache(config=self.config)

    @torch.no_grad()
    def _pass(self, token_ids, cache) -> torch.Tensor:
        """One forward pass (the caller holds the lock) -> logits [vocab] of its last position."""
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device).view(1, -1)
        return self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()

    def _forward(self, token_ids, cache):
        """One forward pass under the lock -> (logits [vocab] of the last position, cache)."""
        with self._lock:
            return self._pass(token_ids, cache), cache

    def _prompt(self, token_ids, cache=None):
        """A prompt as prefill computes it (self.passes), under the lock -> (last logits, cache)."""
        cache = self._cache() if cache is None else cache
        with self._lock:
            for start, end in self.passes.spans(len(token_ids)):
                logits = self._pass(token_ids[start:end], cache)
        return logits, cache

    def reusable(self, prompt_len: int, held: int) -> int:
        """ModelEngine.reusable: the positions prefill computes the same way in any longer prompt."""
        return self.passes.reusable(prompt_len, held)

    def prefill_reuse(self, pool: HybridPool) -> PrefillReuse:
        """ModelEngine.prefill_reuse: resuming after a cached prefix of whole chunks runs the
        prompt's remaining passes on a cache read from the pool, the same bits as the passes
        of one go; not with one pass, nor with state layers (Mamba/GDN: the state at the
        prefix's end would be needed, and prefill keeps no snapshot of it), nor on a TP
        shard (the pool holds this rank's heads, the passes need every head)."""
        no = f"{self.preset}: prefill computes every prompt whole"
        if not self.passes.exact:
            return PrefillReuse(0, f"{no} (one forward pass: {self.passes.note})")
        if self._states:
            return PrefillReuse(
                0,
                f"{no}: its state layers (Mamba/GDN) would resume from the state at the cached "
                "prefix's end, and prefill keeps no snapshot of it",
            )
        if CacheIO(pool, self._states).sharded:
            return PrefillReuse(0, f"{no}: a TP shard's pool holds some heads, and the passes need them all")
        return PrefillReuse(
            self.passes.chunk,
            f"{self.preset}: prefill resumes after a cached prefix of whole {self.passes.chunk}-token chunks",
        )

    def check_pool(self, pool: HybridPool) -> None:
        """The pool must have this model's geometry (one derivation, so this guards a
        hand-built pool or a preset of the same name from elsewhere)."""
        if pool.config.model != self.spec:
            raise ConfigError(
                f"pool geometry {pool.config.model.name!r} is not the one model {self.preset!r} "
                f"keeps (derived from its cache): {self.spec}"
            )

    # ---- ModelEngine ---------------------------------------------------------------------
    def prefill(
        self,
        pool: HybridPool,
        req: RequestKV,
        token_ids: np.ndarray,
        room: int,
        on_layer: Callable[[int], None] | None = None,
        *,
        cached: int = 0,
    ) -> PrefillResult:
        self.check_pool(pool)
        io, n = CacheIO(pool, self._states), len(token_ids)
        if cached and (not self.prefill_reuse(pool).align or cached % self.passes.chunk or cached >= n):
            raise ValueError(f"{self.preset}: cannot resume a {n}-token prompt after {cached} cached positions")
        with torch.no_grad():  # positions [0, cached) as the prompt's earlier passes left them
            cache = io.read_cache(req, cached, self.config) if cached else self._cache()

        span = (0, n)  # the pass under way: the loop below rebinds it, the hook reads it

        def layer_done(i: int) -> None:  # the pass's positions and the state at its end
            io.write_layer(req, i, cache.layers[i], span[1], span[0])
            if on_layer is not None and span[1] == n:
                on_layer(i)

        with self._lock:  # the hooks must see this prefill's cache and no other
            self._layer_done = layer_done
            try:
                for span in self.passes.spans(n, cached):
                    logits = self._pass(token_ids[span[0] : span[1]], cache)
            finally:
                self._layer_done = None
        result = PrefillResult(int(logits.argmax()), prompt_digest(token_ids))
        pool.aux.write(req.aux_row, room, n, result.first_token, result.digest)
        return result

    def verify(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int) -> None:
        """check_aux (a first token in the vocabulary). What the bytes mean is for decode and
        check to show; that they are prefill's, decode checks against its digest."""
        check_aux(pool, req, token_ids, room, lambda token: 0 <= token < self.config.vocab_size)

    def decode(
        self,
        pool: HybridPool,
        req: RequestKV,
        token_ids: np.ndarray,
        max_new_tokens: int,
        stop: Callable[[], bool] | None = None,
    ) -> DecodeOutput:
        first = int(pool.aux.read(req.aux_row)["first_token"])
        return self.generate(pool, req, len(token_ids), first, max_new_tokens, token_ids, stop=stop)

    def generate(
        self,
        pool: HybridPool,
        req: RequestKV,
        n: int,
        next_token: int,
        max_new_tokens: int,
        token_ids: np.ndarray | None = None,
        *,
        stop: Callable[[], bool] | None = None,
    ) -> DecodeOutput:
        """Continue a request whose first n tokens' KV is in the pool and whose next input is
        `next_token` (not in the pool yet): returns max_new_tokens tokens, next_token first.
        On a TP shard, `token_ids` (the n tokens) gives the units other ranks hold. `stop()`
        true before a step raises Cancelled (ModelEngine.decode)."""
        self.check_pool(pool)
        io, timings = CacheIO(pool, self._states), {}
        whole = None
        if io.sharded:
            if token_ids is None or len(token_ids) != n:
                raise ValueError(f"a TP shard continues from its {n} tokens' ids (the other ranks' units)")
            t = time.perf_counter()
            _, whole = self._prompt(token_ids)
            self._sync()
            timings["other_ranks"] = (time.perf_counter() - t) * 1e3
        t0 = time.perf_counter()
        with torch.no_grad():
            cache = io.read_cache(req, n, self.config, whole)
        self._sync()
        t1 = time.perf_counter()
        tokens, logits = [next_token], []
        for i in range(1, max_new_tokens):
            stop_if(stop, i)
            step, cache = self._forward([tokens[-1]], cache)
            pool.extend(req, n + 1)  # allocates a page when one fills, evicts SWA pages
            for i, cl in enumerate(cache.layers):
                io.write_layer(req, i, cl, n + 1, n)
            n += 1
            logits.append(step)
            tokens.append(int(step.argmax()))
        timings.update(rebuild=(t1 - t0) * 1e3, steps=(time.perf_counter() - t1) * 1e3)
        return DecodeOutput(tokens, logits, timings, held_differences=lambda whole: io.differences(req, n, whole))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reference(self, token_ids: np.ndarray, max_new_tokens: int) -> DecodeOutput:
        """The colocated run: the whole model in this process, no pool."""
        return self._reference(token_ids, max_new_tokens)[0]

    def _reference(self, token_ids: np.ndarray, max_new_tokens: int):
        """(the colocated run's output, its cache after the prompt and every token but the last)."""
        step, cache = self._prompt(token_ids)
        tokens, logits = [int(step.argmax())], []
        for _ in range(max_new_tokens - 1):
            step, cache = self._forward([tokens[-1]], cache)
            logits.append(step)
            tokens.append(int(step.argmax()))
        return DecodeOutput(tokens, logits), cache

    def check(self, token_ids: np.ndarray, output: DecodeOutput) -> dict:
        """Tokens and logits against the colocated run, and the bytes this rank holds against
        its shard of the colocated run's cache (decode writes every step back, so the pool now
        holds the cache the colocated run ends with): a rank holding the wrong units fails
        here even where recomputing the others from the prompt gives the right outputs."""
        want, cache = self._reference(token_ids, len(output.tokens))
        out = compare_tokens(want.tokens, output.tokens)
        same = [torch.equal(a, b) for a, b in zip(want.logits, output.logits)]
        diff = max((float((a - b).abs().max()) for a, b in zip(want.logits, output.logits)), default=0.0)
        held = output.held_differences(cache) if output.held_differences is not None and out["token_match"] else []
        return {
            **out,
            "logits_match": all(same) and len(same) == len(want.logits),
            "max_logit_diff": diff,
            "shard_match": out["token_match"] and not held,
            "shard_differences": held[:4],
        }
