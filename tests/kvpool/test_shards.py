"""TP shards (kvpool.shards): what a rank holds of each segment's row, and the slices one rank
of one TP size sends one rank of another, checked byte by byte against the whole row."""

import numpy as np
import pytest

from kvpool import get_preset
from kvpool.errors import SpecError
from kvpool.geometry import Component, components, parts, segments
from kvpool.shards import Part, global_spans, held, reshard, row_bytes

CONV = (Part(4, 6), Part(2, 4), Part(2, 4))  # Mamba2-like [x: 4 heads | B: 2 groups | C: 2 groups]


def test_a_rank_holds_its_share_or_one_replicated_unit():
    assert held(Part(8, 1), 4, 3) == (6, 2)
    assert held(Part(2, 1), 8, 5) == (1, 1)  # 4 ranks share each of 2 heads
    assert held(Part(1, 1), 4, 2) == (0, 1)  # replicated whole
    with pytest.raises(SpecError, match=r"heads \(8\) not divisible by TP size 3"):
        held(Part(8, 1), 3, 0, "heads")
    with pytest.raises(SpecError, match="neither divisible by nor a divisor of TP size 3"):
        held(Part(2, 1), 3, 0)


def test_conv_groups_split_each_group_on_its_own():
    # rank 1 of 2: x heads 2, 3 | B group 1 | C group 1  (global row: x 24 B, B 8 B, C 8 B)
    assert global_spans(CONV, 2, 1) == [(0, 12, 12), (12, 28, 4), (16, 36, 4)]
    assert global_spans(CONV, 4, 3) == [(0, 18, 6), (6, 28, 4), (10, 36, 4)]  # B, C replicated 2 ways
    assert row_bytes(CONV, 4) == 14


def _row(parts_, tp, rank, whole):
    """A rank's row as the whole row's bytes (kvpool.shards.global_spans)."""
    return np.concatenate([whole[g : g + n] for _, g, n in global_spans(parts_, tp, rank)])


@pytest.mark.parametrize("parts_", [CONV, (Part(8, 4),), (Part(2, 8),), (Part(1, 16),)])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (8, 2), (2, 8), (4, 4)])
def test_every_destination_byte_comes_from_exactly_one_source_rank(parts_, n, m):
    whole = np.arange(sum(p.units * p.unit_bytes for p in parts_), dtype=np.int64)
    for d in range(m):
        want = _row(parts_, m, d, whole)
        got = np.full(len(want), -1)
        for r in range(n):
            src = _row(parts_, n, r, whole)
            for s_off, d_off, k in reshard(parts_, (n, r), (m, d)):
                assert (got[d_off : d_off + k] == -1).all(), "a byte written twice"
                got[d_off : d_off + k] = src[s_off : s_off + k]
        assert (got == want).all()


def test_equal_tp_sends_whole_rows_rank_to_rank_only():
    assert reshard(CONV, (2, 1), (2, 1)) == [(0, 0, 20)]
    assert reshard(CONV, (2, 0), (2, 1)) == []


def test_slices_merge_where_both_sides_are_contiguous():
    # TP 1 -> 2, K of 8 heads x 4 B: rank 1 takes heads 4..7 as one slice
    assert reshard((Part(8, 4),), (1, 0), (2, 1)) == [(16, 0, 16)]
    # conv: x, B and C are three slices (they lie apart in the source row)
    assert reshard(CONV, (1, 0), (2, 1)) == [(12, 0, 12), (28, 12, 4), (36, 16, 4)]


@pytest.mark.parametrize(
    "preset", ["gpt-oss-120b", "qwen3-next-80b-a3b", "nemotron-h-8b", "deepseek-v3.2", "tiny-hybrid", "tiny-mamba"]
)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_segments_are_as_long_as_their_parts_say(preset, tp):
    model = get_preset(preset)
    for c in components(model):
        for seg in segments(model, c, 1, tp):
            assert seg.nbytes == row_bytes(parts(model, c, seg.part), tp), (c, seg)


def test_a_transposed_conv_state_splits_every_column_by_its_channel_groups():
    """vLLM keeps a gated-delta-net's conv state [width, q | k | v channels] ("SD"): a rank's
    share is its q, k and v channels of each of the width's columns, not one byte range."""
    from dataclasses import replace

    model = get_preset("qwen3-next-80b-a3b")
    lin = replace(model.linear, conv_transposed=True)
    model = replace(model, linear=lin)
    conv = parts(model, Component.MAMBA, "conv")
    assert conv == ((Part(16, 256), Part(16, 256), Part(32, 256)) * 3)  # 128 channels x bf16 a head, 3 columns
    [seg] = [s for s in segments(model, Component.MAMBA, 1, 2)[:2] if s.part == "conv"]
    assert seg.shape == (3, 4096) and seg.nbytes == row_bytes(conv, 2)
    # TP 1 -> 2, rank 1: per column its q heads 8-15, k heads 8-15, v heads 16-31
    col = 64 * 256  # one column of the whole row, bytes
    assert reshard(conv, (1, 0), (2, 1))[:3] == [
        (8 * 256, 0, 8 * 256),
        (24 * 256, 2048, 8 * 256),
        (48 * 256, 4096, 16 * 256),
    ]
    assert reshard(conv, (1, 0), (2, 1))[3][0] == col + 8 * 256
