"""The model engine interface: what disagg needs from an inference engine (the model that
computes KV; not to be confused with a transport, which moves it). The stand-in
(disagg.engine.standin) implements it without model weights."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpool import HybridPool, RequestKV


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    digest: bytes   # 32 bytes over the prompt; written to the AUX row


class ModelEngine(Protocol):
    def prefill(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int) -> PrefillResult:
        """Compute the prompt's KV into `req` and its AUX row."""

    def verify(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int) -> dict[str, str]:
        """Check what arrived on decode; return a digest per component or raise VerifyError."""

    def decode(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, max_new_tokens: int) -> list[int]:
        """Generate tokens, appending KV (and evicting out-of-window SWA pages)."""
