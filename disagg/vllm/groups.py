"""vLLM's KV cache groups (its hybrid memory allocator, HMA): which of a request's blocks, per
group, carry what a consumer needs, and how a producer's blocks pair with a consumer's.

    group (vLLM spec)          blocks a transfer moves, per group
    FULL  (full attention)     the blocks of the tokens the consumer lacks
    WINDOW (sliding window)    the same, but only the last `window_blocks` of them (older ones
                               are vLLM's null block 0 on either side: such pairs are skipped)
    STATE (Mamba / GDN)        the request's running-state slot: its last block before any
                               speculative scratch slots; it holds the state after exactly the
                               producer's tokens, so a consumer must ask for exactly those

Every group's block ids index one page pool (vLLM gives a block to one group at a time, and
every layer's tensor is a view of the same pages): a pair (source block, destination block)
moves that block's page in every buffer, whatever group it belongs to.

On the wire (TransferRequest.indices) the consumer's blocks go per kind, groups of one kind
concatenated in group order: FULL under "full", WINDOW under "swa", STATE under "mamba".
Both sides derive their groups from the same model and configuration (the layout check at
registration), so the producer splits them the same way; anything else is a ProtocolError.

A consumer of another block size or TP size takes the request by token (transfer.engine_rows),
group by group (token_sends: each group's blocks pair within the group, one planned send each):
FULL, every position from the consumer's prefix (the first its blocks hold) to num_tokens;
WINDOW, the positions both sides' non-null window blocks cover (the planner's SWA rule: what
the producer still holds of the request's window, and the consumer asked for); every group's
layers move at once, as their blocks share the page regions. STATE, the slot's state as one
row (MAMBA: a consumer of another TP size gets the slices of it its heads and channels take,
transfer.reshard; equal TP sizes pair only equal block sizes for a model with state).
"""

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from disagg.errors import ProtocolError
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from kvpool.spec import LinearStateSpec

NULL_BLOCK = 0  # vLLM's null block: a placeholder in a block table, never transferred


class Kind(enum.Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


WIRE = {Kind.FULL: Component.FULL, Kind.WINDOW: Component.SWA, Kind.STATE: Component.MAMBA}


@dataclass(frozen=True)
class Group:
    kind: Kind
    block_size: int
    window_blocks: int = 0  # WINDOW: blocks one window can touch (window / block size, + 1)
    scratch_blocks: int = 0  # STATE: trailing speculative scratch slots (never moved)

    def __post_init__(self) -> None:
        if self.block_size < 1 or (self.kind is Kind.WINDOW and self.window_blocks < 1):
            raise ValueError(f"KV cache group {self}: block size and window must be positive")

    def held(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """Producer: what it keeps of a finished request's block list (STATE: its slot)."""
        if self.kind is not Kind.STATE:
            return tuple(blocks)
        blocks = tuple(blocks)[: len(blocks) - min(self.scratch_blocks, max(len(blocks) - 1, 0))]
        return blocks[-1:]

    def wanted(self, blocks: Sequence[int], first: int, count: int) -> tuple[int, ...]:
        """Consumer: its blocks for prompt tokens [first, first + count)."""
        if self.kind is Kind.STATE:
            return self.held(blocks)
        lo, hi = first // self.block_size, math.ceil((first + count) / self.block_size)
        span = tuple(blocks)[lo:hi]
        return span[-self.window_blocks :] if self.kind is Kind.WINDOW else span

    def source(self, held: Sequence[int], n: int, num_tokens: int, held_tokens: int) -> tuple[int, ...]:
        """Producer: its blocks for a destination of `n` blocks ending at token `num_tokens`
        (the last n blocks of those tokens); ProtocolError for one that cannot be ours."""
        if self.kind is Kind.STATE:
            if n != 1 or num_tokens != held_tokens or len(held) != 1:
                raise ProtocolError(
                    f"a state group pairs one slot at exactly {held_tokens} tokens (asked: {n} at {num_tokens})"
                )
            return tuple(held)
        hi = math.ceil(num_tokens / self.block_size)
        if not 1 <= n <= hi or hi > len(held):
            raise ProtocolError(
                f"{n} destination blocks for {num_tokens} tokens of {self.block_size} per block "
                f"(held: {len(held)} blocks)"
            )
        return tuple(held[hi - n : hi])


@dataclass(frozen=True)
class KVGroups:
    """vLLM's KV cache groups, which layers hold a state (`state`: its geometry in kvpool's
    terms, disagg.vllm.states; None with `state_refusal` saying why it is not described), which
    a sliding window (of at most `window` tokens), and which kernel writes the blocks on CPU
    (`cpu_kernel`: vLLM's CPU attention ISA, "" elsewhere): what register_kv_caches needs to
    describe the tensors it gets."""

    groups: tuple[Group, ...]
    state_layers: frozenset[str] = frozenset()
    window_layers: frozenset[str] = frozenset()
    window: int = 0
    state: LinearStateSpec | None = None
    state_refusal: str = ""
    cpu_kernel: str = ""


@dataclass(frozen=True)
class TokenSend:
    """One group's share of a by-token send: its blocks on either side, under the component
    whose rules the planner applies (FULL or SWA), and the first position the consumer lacks."""

    component: Component
    src: np.ndarray
    dst: np.ndarray
    prefix_len: int = 0


def to_wire(groups: Sequence[Group], per_group: Sequence[Sequence[int]]) -> IndexSet:
    """The consumer's destination blocks, per kind (module docstring)."""
    out: dict[Component, list[int]] = {}
    for g, blocks in zip(groups, per_group, strict=True):
        out.setdefault(WIRE[g.kind], []).extend(blocks)
    return IndexSet({c: np.asarray(b, dtype=np.int32) for c, b in out.items()})


def split(groups: Sequence[Group], dst: IndexSet) -> list[np.ndarray]:
    """An untrusted destination's blocks per group (groups of one kind take equal shares of
    their kind's indices, in group order); ProtocolError for one that does not split so."""
    kinds = {WIRE[g.kind]: [i for i, x in enumerate(groups) if x.kind is g.kind] for g in groups}
    if set(dst.components()) - set(kinds):
        raise ProtocolError(
            f"indices for {sorted(c.value for c in dst.components())}, this producer has groups "
            f"{sorted(c.value for c in kinds)}"
        )
    out: list[np.ndarray] = [np.zeros(0, np.int32)] * len(groups)
    for component, members in kinds.items():
        arr = np.asarray(dst[component] if component in dst.components() else np.zeros(0), np.int32)
        if len(arr) % len(members):
            raise ProtocolError(f"{len(arr)} {component.value} indices do not split into {len(members)} groups")
        n = len(arr) // len(members)
        for k, i in enumerate(members):
            out[i] = arr[k * n : (k + 1) * n]
    return out


def token_sends(
    groups: Sequence[Group],
    held: Sequence[Sequence[int]],
    dst: IndexSet,
    num_tokens: int,
    held_tokens: int,
    *,
    dst_block_size: int,
) -> list[TokenSend]:
    """Producer, a consumer of another block or TP size: per group it asked blocks of, our
    blocks of tokens [0, num_tokens) and its blocks (a window's: both without their leading
    null blocks; a state's slot at exactly the tokens we hold), and for a FULL group the first
    position its blocks hold (its prefix_len). The planner checks the blocks against each
    side's pages. ProtocolError for a destination that cannot be ours."""
    if not 1 <= num_tokens <= held_tokens:
        raise ProtocolError(f"num_tokens {num_tokens} outside [1, {held_tokens}]")
    out = []
    for g, mine, theirs in zip(groups, held, split(groups, dst), strict=True):
        if not len(theirs):
            continue
        if g.kind is Kind.STATE:  # its slot, one row (TP slices of it: transfer.reshard)
            slot = np.asarray(g.source(mine, len(theirs), num_tokens, held_tokens), np.int32)
            out.append(TokenSend(Component.MAMBA, slot, theirs))
            continue
        pages = math.ceil(num_tokens / g.block_size)
        if len(mine) < pages:
            raise ProtocolError(f"{num_tokens} tokens of {g.block_size} per block, held: {len(mine)} blocks")
        src = np.asarray(mine[:pages], np.int32)
        if g.kind is Kind.WINDOW:
            src, theirs = _window(src), _window(theirs)
            if len(src) and len(theirs):
                out.append(TokenSend(Component.SWA, src, theirs))
            continue
        first = (math.ceil(num_tokens / dst_block_size) - len(theirs)) * dst_block_size
        if first < 0:
            raise ProtocolError(f"{len(theirs)} full blocks of {dst_block_size} for {num_tokens} tokens")
        out.append(TokenSend(Component.FULL, src, theirs, first))
    if not out:
        raise ProtocolError(f"no block to move (indices for {sorted(c.value for c in dst.components())})")
    return out


def _window(blocks: np.ndarray) -> np.ndarray:
    """A window group's blocks without the leading null ones (blocks that left the window);
    ProtocolError for a null block after a real one."""
    real = np.flatnonzero(blocks != NULL_BLOCK)
    rest = blocks[real[0] :] if len(real) else blocks[:0]
    if (rest == NULL_BLOCK).any():
        raise ProtocolError(f"a null block inside a window's blocks {rest.tolist()}")
    return rest


def pairs(
    groups: Sequence[Group], held: Sequence[Sequence[int]], dst: IndexSet, num_tokens: int, held_tokens: int
) -> tuple[np.ndarray, np.ndarray]:
    """Producer: (source blocks, destination blocks), pair by pair, for an untrusted destination;
    pairs with a null block on either side are left out. ProtocolError for a destination that
    does not split into our groups."""
    if not 1 <= num_tokens <= held_tokens:
        raise ProtocolError(f"num_tokens {num_tokens} outside [1, {held_tokens}]")
    src_all, dst_all = [], []
    for g, mine, theirs in zip(groups, held, split(groups, dst), strict=True):
        if len(theirs):
            src_all.extend(g.source(mine, len(theirs), num_tokens, held_tokens))
            dst_all.extend(theirs.tolist())
    src, dst_arr = np.asarray(src_all, np.int32), np.asarray(dst_all, np.int32)
    keep = (src != NULL_BLOCK) & (dst_arr != NULL_BLOCK)
    if not keep.any():
        raise ProtocolError("no block to move")
    return src[keep], dst_arr[keep]
