"""TransferReport.merge: the one rule by which the reports of sends that ran at once combine
(prefill per destination, decode per sender, the router per rank)."""

import itertools

import msgspec
import pytest

from transfer.config import Mode
from transfer.report import REPORT_KEYS, TransferReport, merged

A = TransferReport(
    mode=Mode.DIRECT,
    transport="mooncake",
    nbytes=100,
    ranges=3,
    chunks=0,
    groups=1,
    streamed=False,
    prepared_ahead=True,
    transfer_ms=2.0,
    plan_ms=0.5,
    prepare_ms=0.7,
    submit_ms=0.2,
    wait_ms=1.5,
    cpu_ms=1.0,
    after_compute_ms=2.0,
    first_write_at=1000.25,
)
B = TransferReport(
    mode=Mode.STAGED,
    transport="cuda-ipc",
    nbytes=50,
    ranges=5,
    chunks=4,
    groups=6,
    streamed=True,
    prepared_ahead=False,
    transfer_ms=3.0,
    plan_ms=0.1,
    prepare_ms=0.2,
    submit_ms=0.0,
    wait_ms=0.5,
    cpu_ms=2.5,
    after_compute_ms=0.5,
    first_write_at=1000.5,
)
C = TransferReport(
    mode=Mode.DIRECT, transport="mooncake", nbytes=7, ranges=1, transfer_ms=9.0, prepared_ahead=True, first_write_at=0.0
)  # wrote nothing before its AUX row: no first write


def test_amounts_add_up_durations_are_the_slowest_and_the_first_write_the_earliest():
    m = A.merge(B)
    assert (m.nbytes, m.ranges, m.chunks, m.sends) == (150, 8, 4, 2)
    assert (m.transfer_ms, m.plan_ms, m.prepare_ms, m.submit_ms, m.wait_ms, m.after_compute_ms) == (
        3.0,
        0.5,
        0.7,
        0.2,
        1.5,
        2.0,
    )
    assert m.cpu_ms == 3.5  # CPU time of threads of their own adds up
    assert m.groups == 6  # the finest cut of the request's layers
    assert m.first_write_at == 1000.25
    assert A.merge(C).first_write_at == 1000.25 and C.merge(C).first_write_at == 0.0  # 0: none, not earliest


def test_modes_and_transports_are_the_distinct_ones_sorted_and_joined():
    m = A.merge(B)
    assert m.mode == "direct+staged" and m.transport == "cuda-ipc+mooncake"
    assert A.merge(C).mode == "direct" and A.merge(C).transport == "mooncake"
    assert m.merge(A).mode == "direct+staged"  # a merged name joins as its parts
    assert A.mode is Mode.DIRECT  # one send's mode is the Mode itself


def test_streamed_if_any_was_prepared_ahead_only_if_all_were():
    assert A.merge(B).streamed and not A.merge(C).streamed
    assert A.merge(C).prepared_ahead and not A.merge(B).prepared_ahead


@pytest.mark.parametrize("order", list(itertools.permutations([A, B, C])))
def test_the_order_of_merging_does_not_matter(order):
    assert merged(order) == A.merge(B).merge(C) == A.merge(B.merge(C))


def test_merged_skips_sends_that_made_no_report():
    assert merged([]) is None and merged([None, None]) is None
    assert merged([None, A, None]) is A


def test_it_travels_under_the_answers_keys_and_refuses_what_it_cannot_be():
    wire = A.to_dict()
    assert (
        {
            "bytes",
            "mode",
            "transport",
            "ranges",
            "transfer_ms",
            "transfer_cpu_ms",
            "layer_groups",
            "streamed",
            "first_write_at",
            "prepared_ahead",
            "prepare_ms",
            "after_compute_ms",
        }
        <= set(wire)
        == REPORT_KEYS
    )
    assert wire["mode"] == "direct" and type(wire["mode"]) is str
    assert msgspec.convert(wire, TransferReport) == A  # round trip (mode back as its plain string)
    assert msgspec.json.decode(msgspec.json.encode(A), type=TransferReport) == A
    for bad in ({"bytes": -1}, {"bytes": "many"}, {"transfer_ms": -0.5}, {"streamed": "yes"}, {"layer_groups": 1.5}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, TransferReport)


def test_a_fan_out_is_named_by_its_largest():
    """`fanout`: receivers one write covered (transfer.fanout); merged: the largest, 0 where none."""
    fanned = TransferReport(nbytes=5, fanout=8)
    assert A.merge(fanned).fanout == 8 and A.merge(B).fanout == 0
    assert TransferReport.merge(fanned, TransferReport(fanout=2)).fanout == 8
