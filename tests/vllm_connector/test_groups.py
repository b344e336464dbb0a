"""disagg.vllm.groups: which blocks of each KV cache group move, and how an untrusted
destination pairs with what a producer holds."""

import pytest

from disagg.errors import ProtocolError
from kvpool.geometry import Component
from disagg.vllm.groups import Group, Kind, pairs, to_wire, token_sends

FULL, WINDOW, STATE = Group(Kind.FULL, 32), Group(Kind.WINDOW, 32, 3), Group(Kind.STATE, 512, scratch_blocks=1)


def test_consumer_wants_its_missing_blocks_a_windows_last_ones_and_the_state_slot():
    blocks = [1, 2, 3, 4]
    assert FULL.wanted(blocks, 64, 36) == (3, 4)  # tokens 64..99: blocks 2 and 3
    assert WINDOW.wanted(blocks, 0, 100) == (2, 3, 4)  # only the window's last 3
    assert STATE.wanted([7, 8], 0, 99) == (7,)  # the running slot, not the scratch slot
    assert Group(Kind.STATE, 512).held([0, 5]) == (5,)  # null placeholders before the slot


def test_pairs_follow_the_groups_and_skip_null_blocks():
    groups = (STATE, WINDOW, FULL)
    held = ((5,), (0, 3, 4, 6), (8, 9, 10, 11))
    dst = to_wire(groups, ((9,), (12, 13, 14, 15), (1, 2, 5, 7)))
    src, got = pairs(groups, held, dst, 100, 100)
    assert list(zip(src.tolist(), got.tolist())) == [
        (5, 9),
        (3, 13),
        (4, 14),
        (6, 15),
        (8, 1),
        (9, 2),
        (10, 5),
        (11, 7),
    ]


def test_a_suffix_pairs_with_the_last_blocks():
    src, dst = pairs((FULL,), ((8, 9, 10, 11),), to_wire((FULL,), ((2, 3),)), 100, 100)
    assert (src.tolist(), dst.tolist()) == ([10, 11], [2, 3])


@pytest.mark.parametrize(
    "dst, num_tokens, match",
    [
        (((9,), (1, 2, 5, 7)), 99, "exactly 100 tokens"),  # a state at another length
        (((9, 10), (1, 2, 5, 7)), 100, "one slot"),
        (((9,), (1, 2, 5, 7, 8)), 100, "5 destination blocks"),
        (((9,), (1, 2, 5, 7)), 101, r"outside \[1, 100\]"),
    ],
)
def test_a_destination_that_cannot_be_ours_is_refused(dst, num_tokens, match):
    groups = (STATE, FULL)
    with pytest.raises(ProtocolError, match=match):
        pairs(groups, ((5,), (8, 9, 10, 11)), to_wire(groups, dst), num_tokens, 100)


def test_indices_of_a_kind_the_producer_lacks_are_refused():
    with pytest.raises(ProtocolError, match="mamba"):
        pairs((FULL,), ((8, 9),), to_wire((STATE, FULL), ((3,), (1, 2))), 64, 64)
    with pytest.raises(ProtocolError, match="do not split"):
        pairs((FULL, FULL), ((8, 9), (4, 5)), to_wire((FULL,), ((1, 2, 3),)), 64, 64)


def _sends(groups, held, dst, n, bs=64):
    return [
        (t.component, t.src.tolist(), t.dst.tolist(), t.prefix_len)
        for t in token_sends(groups, held, to_wire(groups, dst), n, 100, dst_block_size=bs)
    ]


def test_a_consumer_of_another_block_size_takes_our_blocks_of_its_tokens():
    """By token (transfer.engine_rows): our blocks of tokens [0, num_tokens), its blocks as
    sent, and the first position they hold (its prefix); what cannot be ours is refused."""
    held = ((3, 4, 5, 6),)
    assert _sends((FULL,), held, ((14,),), 100) == [(Component.FULL, [3, 4, 5, 6], [14], 64)]
    assert _sends((FULL,), held, ((9, 2, 7, 8, 1),), 40, bs=8) == [(Component.FULL, [3, 4], [9, 2, 7, 8, 1], 0)]
    for groups, dst, n, message in [
        ((FULL,), ((1, 2, 3),), 100, "3 full blocks of 64 for 100 tokens"),  # more blocks than tokens
        ((FULL,), ((),), 100, "no block to move"),
        ((FULL,), ((1,),), 101, "num_tokens 101 outside"),
        ((WINDOW, FULL), ((1, 0, 2), (3, 4)), 100, "a null block inside a window"),
        ((FULL, FULL), ((1, 2), (3,)), 100, "3 full indices do not split into 2 groups"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            token_sends(groups, held * len(groups), to_wire(groups, dst), n, 100, dst_block_size=64)


def test_each_group_pairs_by_token_within_itself_a_window_without_its_null_blocks():
    """Gemma3-style groups (window, full, window) at another block size: a send per group, the
    full group's from the consumer's prefix, each window's from the blocks both sides hold (our
    block that left the window, its placeholder, dropped); a window asked for nothing: none."""
    held = ((0, 3, 4, 5), (6, 7, 8, 9), (0, 0, 10, 11))
    groups = (WINDOW, FULL, WINDOW)
    assert _sends(groups, held, ((0, 12), (13,), (14, 15)), 100) == [
        (Component.SWA, [3, 4, 5], [12], 0),
        (Component.FULL, [6, 7, 8, 9], [13], 64),
        (Component.SWA, [10, 11], [14, 15], 0),
    ]
    assert _sends(groups, held, ((), (13,), ()), 100) == [(Component.FULL, [6, 7, 8, 9], [13], 64)]


def test_a_state_group_sends_its_slot_as_one_row_at_exactly_the_tokens_held():
    """Qwen3-Next-style groups at another TP size: the state's slot as a MAMBA row (its TP
    slices: transfer.reshard), the full group's blocks by token; a state asked at another
    length than the producer holds is refused."""
    held = ((5,), (6, 7, 8, 9))
    assert _sends((STATE, FULL), held, ((9,), (13,)), 100) == [
        (Component.MAMBA, [5], [9], 0),
        (Component.FULL, [6, 7, 8, 9], [13], 64),
    ]
    with pytest.raises(ProtocolError, match="a state group pairs one slot at exactly 100 tokens"):
        _sends((STATE, FULL), held, ((9,), (13,)), 99)
