r"""Suffix-only transfers: a receiver that already holds the first positions of a request (its
own cached prefix) names the first position it lacks, `prefix_len`, and only the rest moves.

    positions     0 .............. prefix_len ............... n - W ........ n
    FULL/MLA/NSA  |  the receiver's own  |          moved                    |
    SWA (window W: what decode reads is [n - W, n))
                  prefix_len <= n - W:   the window moves whole, as without a prefix
                  prefix_len >  n - W:   [n - W, prefix_len) is the receiver's own; [prefix_len, n) moves
    state, AUX    whole: the state is the one at the prompt's end, the AUX row the request's

prefix_len is a multiple of the receiver's page size, so a receiver page is either its own or
written whole; the sender's pages may split at prefix_len (pools of different page sizes move
by token anyway). The receiver's index arrays still cover the whole request (FULL, NSA: every
page; SWA: the window's pages): prefix_len alone says where writing starts, and the receiver
refuses a staged piece below it (transfer.staging.scatter). By token they may instead start
at prefix_len's page (a vLLM consumer names only the blocks of the tokens it lacks).

    whole pages (same page size and shard)   items of each index array from the page holding
                                             prefix_len on (SWA: counted from the window's first)
    by token (other page or TP sizes)        positions from max(prefix_len, what both sides cover)

prefix_len comes off the wire (decode's TransferRequest): checked here before anything is
planned, a BadPrefix naming what is wrong.
"""

from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from transfer.errors import BadPrefix


def check_prefix(prefix_len, num_tokens: int, page_size: int) -> int:
    """`prefix_len` as a plain int once it is one the receiver may name for a request of
    `num_tokens` held in pages of `page_size` (the receiver's); BadPrefix otherwise."""
    if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)):
        raise BadPrefix(f"prefix_len {prefix_len!r} is not an integer")
    if prefix_len < 0:
        raise BadPrefix(f"prefix_len {prefix_len} is negative")
    if prefix_len > num_tokens:
        raise BadPrefix(f"prefix_len {prefix_len} is beyond the prompt's {num_tokens} tokens")
    if prefix_len % page_size:
        raise BadPrefix(f"prefix_len {prefix_len} is not a multiple of the receiver's page size {page_size}")
    return int(prefix_len)


@dataclass(frozen=True)
class Suffix:
    """The part of a request of `num_tokens` a transfer moves: the receiver (pages of
    `page_size`) holds positions [0, prefix_len) already. Checked when built."""

    num_tokens: int
    prefix_len: int
    page_size: int  # the receiver's

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_len", check_prefix(self.prefix_len, self.num_tokens, self.page_size))

    def first_item(self, component: Component, length: int) -> int:
        """Whole pages (both sides' page size is `page_size`): the first of a component's
        `length` aligned indices whose page holds a position the receiver lacks. FULL, NSA:
        index i is page i; a windowed component's (SWA) cover the request's last pages."""
        if component.per_request or not self.prefix_len:
            return 0
        first_page = -(-self.num_tokens // self.page_size) - length if component.windowed else 0
        return min(length, max(0, self.prefix_len // self.page_size - first_page))

    def first_position(self, covered: int) -> int:
        """By token: the first position to move of those both sides cover from `covered` on."""
        return max(covered, self.prefix_len)


def suffix_of(num_tokens: int | None, prefix_len, page_size: int) -> Suffix | None:
    """The Suffix a send into a receiver of `page_size` moves; None without a prefix (all of it)."""
    if type(prefix_len) is int and prefix_len == 0:
        return None
    if num_tokens is None:
        raise BadPrefix("a prefix_len needs the request's num_tokens to plan with")
    return Suffix(num_tokens, prefix_len, page_size)
