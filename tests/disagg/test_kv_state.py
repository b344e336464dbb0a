import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.control.phases import InvalidTransition, KVPoll, TransferState


def test_happy_path():
    s = TransferState(7)
    assert s.poll() is KVPoll.BOOTSTRAPPING
    s.advance(KVPoll.WAITING_FOR_INPUT)
    s.advance(KVPoll.TRANSFERRING)
    s.complete(7)
    assert s.poll() is KVPoll.SUCCESS and s.wait(0) is KVPoll.SUCCESS


def test_success_for_another_room_is_refused():
    s = TransferState(7)
    s.advance(KVPoll.TRANSFERRING)
    with pytest.raises(InvalidTransition, match="room 8 offered to room 7"):
        s.complete(8)
    assert s.poll() is KVPoll.TRANSFERRING


def test_success_only_from_transferring_and_failure_is_sticky():
    s = TransferState(1)
    with pytest.raises(InvalidTransition):
        s.complete(1)
    assert s.fail("peer died") and s.poll() is KVPoll.FAILED and s.reason == "peer died"
    assert not s.fail("again") and s.reason == "peer died"
    with pytest.raises(InvalidTransition):
        s.advance(KVPoll.TRANSFERRING)


@given(st.lists(st.sampled_from(list(KVPoll)), max_size=12))
def test_transitions_only_go_forward(steps):
    s = TransferState(3)
    seen = [s.poll()]
    for to in steps:
        try:
            if to is KVPoll.SUCCESS:
                s.complete(3)
            elif to is KVPoll.FAILED:
                s.fail("x")
            else:
                s.advance(to)
        except InvalidTransition:
            pass
        seen.append(s.poll())
    assert seen == sorted(seen)
    assert sum(1 for x in seen if x.terminal) == 0 or seen[-1].terminal


def test_wait_wakes_on_completion_from_another_thread():
    s = TransferState(5)
    s.advance(KVPoll.TRANSFERRING)
    t = threading.Thread(target=s.complete, args=(5,))
    t.start()
    assert s.wait(10) is KVPoll.SUCCESS
    t.join()


def test_each_phase_has_its_own_deadline_counted_from_entering_it():
    from disagg.control.phases import Deadlines
    s = TransferState(3)
    deadlines = Deadlines(bootstrap_s=30, waiting_s=0.05, transfer_s=30)
    s.advance(KVPoll.WAITING_FOR_INPUT)
    assert s.wait_phased(deadlines, "decode") is KVPoll.FAILED
    assert s.reason == ("decode: WAITING_FOR_INPUT deadline of 0.05 s passed "
                        "(prefill never started the transfer)")


def test_moving_on_restarts_the_clock_and_an_end_wakes_the_waiter():
    from disagg.control.phases import Deadlines
    s = TransferState(4)
    deadlines = Deadlines(bootstrap_s=30, waiting_s=30, transfer_s=30)
    ended = threading.Thread(target=lambda: (s.advance(KVPoll.TRANSFERRING), s.complete(4)))
    ended.start()
    assert s.wait_phased(deadlines, "prefill") is KVPoll.SUCCESS
    ended.join()


def test_deadlines_must_be_positive():
    from disagg.control.phases import Deadlines
    with pytest.raises(ValueError, match="waiting_s"):
        Deadlines(waiting_s=0)
