"""The model engine interface: what disagg needs from an inference engine (the model that
computes KV; not to be confused with a transport, which moves it). Two implementations,
chosen with --engine (disagg.engine.registry):

    standin   deterministic bytes, no weights: fast, any preset     (engine/standin.py)
    model     transformers model code, seeded random weights         (engine/model/)

A request's life through an engine: prefill (KV into the pool, first token into the AUX
row; `on_layer(i)` as each layer's KV is final) -> transfer -> verify (on decode: the AUX
row describes this prompt; decode also compares the bytes with prefill's digest of them) ->
decode (continue from the pool alone) -> check (optional: the same prompt run colocated,
compared token for token and logit for logit).
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from disagg.errors import VerifyError
from kvpool import HybridPool, ModelSpec, RequestKV
from transfer.errors import Cancelled


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    digest: bytes  # 32 bytes over the prompt; written to the AUX row


@dataclass(frozen=True)
class PrefillReuse:
    """What a prefill's prefix cache may skip with an engine on a pool (ModelEngine.prefill_reuse)."""

    align: int  # a reused prefix is a multiple of this many tokens; 0: none (every prompt computed whole)
    note: str  # why, in the engine's words (prefill's startup log)


@dataclass(frozen=True)
class DecodeOutput:
    tokens: list[int]  # the first token (from prefill) and the rest
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] float32 per generated step after the first
    timings_ms: dict[str, float] = field(default_factory=dict)  # the engine's own split, e.g. rebuild / steps
    # where this rank's pool bytes differ from its units of the colocated run's cache of the
    # same tokens (a callable of that cache, so only a checked request pays for the compare)
    held_differences: Callable[[object], list[str]] | None = field(default=None, compare=False, repr=False)


def prompt_digest(token_ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).digest()


def check_aux(
    pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int, first_token_ok: Callable[[int], bool]
) -> None:
    """The AUX row arrived last and names this room, this prompt and a first token the engine
    could have computed (every engine's verify starts here); else VerifyError."""
    aux = pool.aux.read(req.aux_row)
    if int(aux["room"]) != room:
        raise VerifyError(f"aux row carries room {int(aux['room'])}, expected {room}")
    if int(aux["num_tokens"]) != len(token_ids) or bytes(aux["digest"]) != prompt_digest(token_ids):
        raise VerifyError("aux row describes another prompt")
    if not first_token_ok(int(aux["first_token"])):
        raise VerifyError(f"aux row first token {int(aux['first_token'])} is not this prompt's")


def stop_if(stop: Callable[[], bool] | None, step: int) -> None:
    """Cancelled when the request's generation must stop (engines call it before each step)."""
    if stop is not None and stop():
        raise Cancelled(f"generation stopped before step {step}: the request was aborted")


def compare_tokens(want: list[int], got: list[int]) -> dict:
    """The check's token half: whether they match and the first index where they differ."""
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if first is None and len(want) != len(got):
        first = min(len(want), len(got))
    return {"token_match": first is None, "first_mismatch": first}


class ModelEngine(Protocol):
    name: str
    spec: ModelSpec | None  # the pool geometry the engine needs (None: it fills any preset)
    vocab_size: int | None  # token ids it takes are below this (None: any)
    byte_digest: bool  # prefill digests the KV and decode compares what arrived with it
    # (False: the engine's verify checks every byte itself)
    exact_reuse: bool  # some of its KV of a prefix is the same bits in every prompt that
    # starts with it (`reusable`): decode may keep a prefix cache
    reuse_note: str  # what decode's startup log says about that

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
        """Compute the prompt's KV into `req` and its AUX row; call on_layer(i) once layer i's
        KV is in the pool (in layer order for a forward pass). `cached`: positions [0, cached)
        of `req` hold this prompt's KV already (prefill's prefix cache lent them; a multiple
        of prefill_reuse's align): only the rest is computed, and those are never written."""

    def prefill_reuse(self, pool: HybridPool) -> PrefillReuse:
        """Whether prefill on `pool` may resume a prompt after a cached prefix and get the bits
        it would compute in one go (and at what alignment), or why not."""

    def verify(self, pool: HybridPool, req: RequestKV, token_ids: np.ndarray, room: int) -> None:
        """The engine's checks of what arrived on decode (check_aux; the stand-in also every
        byte, which it can recompute); VerifyError if one fails. That the bytes are those
        prefill wrote, decode checks against prefill's digest (disagg.control.digests) for an
        engine with `byte_digest` (the model engine, whose outputs could hide a wrong byte)."""

    def decode(
        self,
        pool: HybridPool,
        req: RequestKV,
        token_ids: np.ndarray,
        max_new_tokens: int,
        stop: Callable[[], bool] | None = None,
    ) -> DecodeOutput:
        """Generate tokens from the pool, appending KV (and evicting out-of-window SWA pages).
        Before every step, `stop()` true (the request was aborted) raises Cancelled: the
        pages it holds are freed at once, not when the last token is done."""

    def reusable(self, prompt_len: int, held: int) -> int:
        """Of a finished request's `held` positions (a prompt of prompt_len tokens, then
        generated ones), how many leading ones hold what prefill would compute for them in
        any prompt that starts with the same tokens: what decode's prefix cache may keep."""

    def check(self, token_ids: np.ndarray, output: DecodeOutput) -> dict:
        """Compare `output` with the same prompt run colocated: token_match, logits_match, ..."""
