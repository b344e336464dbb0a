r"""How the model engine computes a prompt, so that a prefix's KV is the same bits in every
prompt that starts with it: decode's prefix cache may then reuse it (issue 39).

Measured on CPU (scripts/measure_reuse.py, every tiny family, positions [0, n1) of every
layer's K/V, MLA latent, NSA keys):

    one pass over n1 tokens  vs  one pass over n2 > n1      differ (~1e-6) in most families:
                                                            kernels' shapes, Mamba/GDN chunk
                                                            counts and MoE groups follow n
    decode steps             vs  one pass                   differ (up to 0.15 on Mamba2)
    passes of C tokens at multiples of C, n1 vs n2          equal, every family, C = 1, 8, 16:
                                                            a whole chunk's pass has the same
                                                            shapes and inputs in both

So prefill computes a prompt in passes of `chunk` tokens, and the KV of positions below the
prompt's last whole chunk is what any longer prompt's prefill computes there:

    prompt of 27, chunk 8:   [0, 8) [8, 16) [16, 24) [24, 27)
                             \______ reusable _____/ \_ not: its pass is shorter _/
    generated tokens         decode steps: not reusable (chunk 1: a step is a pass, all are)

The colocated run a request is checked against is the same engine computing each turn's
whole prompt in these passes, then greedy steps: with reuse or without, decode holds its bits.

A pass on top of a cache must compute what one pass would (up to rounding): some models'
code ignores the cache's state for a multi-token input (jamba, bamba: logits off by 0.8-3
of ~15). `pin_passes` probes that when the engine is built and falls back to one pass, with
the prefix cache off, where it does not hold.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from disagg.errors import ConfigError

CLOSE = 1e-2  # a chunked probe's logits within 1% of their largest: the model's (bad ones: 5-20%)


@dataclass(frozen=True)
class Passes:
    chunk: int  # tokens per prefill pass, at positions that are multiples of it; 0: one pass
    note: str  # what decode's startup log says about reuse

    @property
    def exact(self) -> bool:
        return self.chunk > 0

    def spans(self, n: int, cached: int = 0) -> list[tuple[int, int]]:
        """The prompt's passes as [start, end) position ranges (from `cached` on: a multiple
        of the chunk, the passes before it done)."""
        size = self.chunk or max(n, 1)
        return [(start, min(start + size, n)) for start in range(cached, n, size)]

    def reusable(self, prompt_len: int, held: int) -> int:
        """Of a finished request's `held` positions (a prompt of prompt_len, then generated
        tokens), how many leading ones any prompt starting with the same tokens gets the same
        bits for: the whole chunks of the prompt (chunk 1: every position, a decode step
        being a pass of one token); 0 with one pass."""
        if self.chunk == 1:
            return held
        return min(held, prompt_len // self.chunk * self.chunk) if self.chunk else 0


def pin_passes(forward: Callable, new_cache: Callable, vocab_size: int, name: str, chunk: int) -> Passes:
    """The passes a model computes prompts in: `chunk` tokens if it continues a cache
    correctly (a probe of two whole chunks and a part against one pass), else one pass.
    forward(tokens, cache) -> (last logits, cache) is one pass; new_cache() an empty cache."""
    if chunk < 0:
        raise ConfigError(f"{name}: prefill chunk {chunk}: tokens per pass, 0 for one pass")
    if chunk == 0:
        return Passes(
            0,
            f"{name}: prompts run in one forward pass, whose KV of a prefix depends on the "
            "prompt's length in its last bits: no prefix cache",
        )
    tokens = np.arange(2 * chunk + 3) % vocab_size
    one, cache = forward(tokens, new_cache())
    cache = new_cache()
    try:
        for start, end in Passes(chunk, "").spans(len(tokens)):
            got, cache = forward(tokens[start:end], cache)
    except Exception as exc:  # the model code cannot continue a cache by several tokens at once (on
        # an H100, deepseek-v32's concatenates a 1-token and a 4-token cache entry and raises)
        return Passes(
            0,
            f"{name}: the model code fails to continue a cache with {chunk}-token passes "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): prompts run in one pass, "
            "no prefix cache",
        )
    off, scale = float((got - one).abs().max()), float(one.abs().max())
    if not torch.isfinite(got).all() or off > CLOSE * scale:
        return Passes(
            0,
            f"{name}: the model code does not continue a cache with {chunk}-token passes (logits "
            f"off by {off:.3g} of {scale:.3g} against one pass): prompts run in one pass, no prefix cache",
        )
    what = "every position it holds" if chunk == 1 else f"a prompt's whole {chunk}-token prefill chunks"
    return Passes(chunk, f"{name}: prompts run in passes of {chunk} tokens: decode may reuse {what}")
