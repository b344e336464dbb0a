"""The KV-aware choice is a pure function (disagg/router/scoring.py): the pair holding more of
the prompt wins, load weighed by --kv-load-weight can outweigh it (and decides at equal reuse),
a decode short of free pages pays for what it lacks, ties go round robin, and a cost that
separates into prefill and decode picks the two independently over every pairing."""

import itertools

import pytest

from disagg.router.scoring import Candidate, choose, cost, tied


def test_the_pair_holding_more_of_the_prompt_wins():
    cands = [Candidate(decode_cached=0), Candidate(decode_cached=512), Candidate(decode_cached=256)]
    assert choose(cands, 600, 1.0) == 1
    assert choose(cands, 600, 1.0, start=2) == 1


def test_the_prefill_holding_more_of_the_prompt_wins_against_its_load():
    """The same decode behind two prefills: the one that would compute less wins, until what
    is in flight on it, by the weight, costs more than what it saves."""
    cands = [Candidate(prefill_cached=0), Candidate(prefill_cached=480, inflight=300)]
    assert choose(cands, 600, 1.0) == 1  # 120 + 300 < 600
    assert choose(cands, 600, 2.0) == 0  # 120 + 600 > 600
    assert cost(cands[1], 600, 1.0) == 600 + 120 + 300
    assert not tied(cands, 600, 1.0)


def test_load_outweighs_reuse_by_its_weight():
    cands = [Candidate(decode_cached=512, inflight=4096), Candidate(decode_cached=0)]
    assert choose(cands, 600, 1.0) == 1  # 88 + 600 + 4096 > 600 + 600
    assert choose(cands, 600, 0.0) == 0  # reuse alone
    assert choose(cands, 600, 0.1) == 0  # 88 + 600 + 409.6 < 1200


def test_a_busier_pair_loses_at_equal_reuse():
    """Two pairs holding as much of the prompt: the one with fewer tokens queued and running
    (as the workers report them, or the router's own where more: disagg/router/load.py) wins,
    at any weight above 0, whatever the turn."""
    quiet, busier = Candidate(256, 128, inflight=300), Candidate(256, 128, inflight=301)
    for weight in (0.01, 1.0, 50.0):
        assert choose([busier, quiet], 600, weight) == 1
        assert choose([quiet, busier], 600, weight, start=1) == 0
        assert not tied([quiet, busier], 600, weight)
    assert tied([quiet, busier], 600, 0.0)  # reuse alone: the turn decides


def test_a_decode_short_of_pages_pays_for_what_it_lacks():
    full = Candidate(decode_cached=100, free=50)  # lacks 600 - 100 - 50 = 450
    assert cost(full, 600, 1.0) == 500 + 600 + 450
    assert choose([full, Candidate(decode_cached=0, free=10_000)], 600, 1.0) == 1
    assert cost(Candidate(free=None), 600, 1.0) == 1200  # not known: no penalty


def test_ties_go_round_robin():
    cands = [Candidate()] * 3
    assert [choose(cands, 64, 1.0, start=s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError):
        choose([], 64, 1.0)


def test_every_pairing_listed_chooses_prefill_and_decode_independently():
    prefills = [Candidate(prefill_cached=c, inflight=i) for c, i in [(0, 0), (300, 50), (100, 900)]]
    decodes = [
        Candidate(decode_cached=c, inflight=i, free=f) for c, i, f in [(0, 0, None), (400, 10, 5000), (500, 800, 5000)]
    ]
    pairs = list(itertools.product(range(3), range(3)))
    cands = [
        Candidate(
            decodes[d].decode_cached,
            prefills[p].prefill_cached,
            prefills[p].inflight + decodes[d].inflight,
            decodes[d].free,
        )
        for p, d in pairs
    ]
    n = 600
    best_p = min(range(3), key=lambda p: n - prefills[p].prefill_cached + prefills[p].inflight)
    best_d = min(range(3), key=lambda d: cost(decodes[d], n, 1.0) - n)
    assert pairs[choose(cands, n, 1.0)] == (best_p, best_d) == (1, 1)


def test_a_tie_is_told_apart_from_a_choice_by_cost():
    assert tied([Candidate(), Candidate()], 64, 1.0)
    assert not tied([Candidate(), Candidate(decode_cached=16)], 64, 1.0)
