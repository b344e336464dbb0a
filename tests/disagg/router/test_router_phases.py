"""The router's hand-off phases over TP instances (router/phases.py after answers.merge_ranks):
differences of wall clocks that are never negative (issue 40)."""

from disagg.router.answers import merge_ranks as merge_answers
from disagg.router.answers import read_answer
from disagg.router.phases import handoff_ms

T0 = 1_800_000_000.0


def prefill_rank(done_at: float, end_at: float) -> dict:
    return {
        "state": "SUCCESS",
        "bytes": 7_557_120,
        "prefill_done_at": done_at,
        "transfer_end_at": end_at,
        "transfer_ms": (end_at - done_at) * 1e3,
        "after_compute_ms": (end_at - done_at) * 1e3,
    }


def decode_rank(ready_at: float) -> dict:
    return {"state": "SUCCESS", "verified": True, "output_tokens": [3, 4], "kv_ready_at": ready_at}


def merge_ranks(outs: list[dict]):
    return merge_answers([read_answer(o, f"rank {i}") for i, o in enumerate(outs)])


def phases(pre, dec) -> tuple[float | None, float | None]:
    return handoff_ms(pre.prefill_done_at, pre.report.end_at, dec.kv_ready_at)


def test_eight_ranks_that_finished_computing_apart_give_no_negative_control():
    """As measured at TP 8 -> 1: the ranks' compute ended 0.27 s apart (eight processes on two
    cores), each sent as soon as its own compute was done, and all sends ended together (one
    decode rank's link): the slowest send started 1.9 s before the last compute ended."""
    pre = merge_ranks([prefill_rank(T0 + 0.27 * r, T0 + 21.4 + 0.001 * r) for r in range(8)])
    dec = merge_ranks([decode_rank(T0 + 21.4095)])
    after, control = phases(pre, dec)
    assert after == (T0 + 21.4095 - (T0 + 0.27 * 7)) * 1e3
    assert 0 < control < 5, control  # TransferDone's trip: 2.5 ms, not -1,890 ms
    assert after - pre.report.transfer_ms < 0  # what the router computed before: negative


def test_one_rank_is_unchanged_and_several_decode_ranks_wait_for_the_last():
    pre = merge_ranks([prefill_rank(T0, T0 + 0.040)])
    after, control = phases(pre, merge_ranks([decode_rank(T0 + 0.041), decode_rank(T0 + 0.043)]))
    assert round(after, 3) == 43.0 and round(control, 3) == 3.0


def test_clocks_of_two_hosts_that_disagree_still_give_no_negative_phase():
    """Decode's clock 10 ms behind prefill's: the last guard reports 0, never below."""
    pre = merge_ranks([prefill_rank(T0, T0 + 0.005)])
    assert phases(pre, merge_ranks([decode_rank(T0 - 0.004)])) == (0.0, 0.0)


def test_a_missing_clock_gives_no_phase():
    assert handoff_ms(T0, None, None) == (None, None)
    assert handoff_ms(T0, 0.0, T0 + 1)[1] is None  # a send that reported no end: no control phase
