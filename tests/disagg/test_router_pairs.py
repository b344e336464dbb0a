"""How the router merges the answers of an instance's ranks into one (router/pairs.merge_ranks)."""

from disagg.router.pairs import merge_ranks


def ok(**more) -> dict:
    return {"state": "SUCCESS", "output_tokens": [3, 4], "verified": True, "bytes": 10, "transfer_ms": 1.0, **more}


def test_one_rank_is_its_own_answer():
    assert merge_ranks([ok(bytes=7)]) == ok(bytes=7)


def test_the_first_failed_rank_speaks_and_is_named():
    out = merge_ranks([ok(), {"state": "FAILED", "reason": "peer lost"}, {"state": "FAILED", "reason": "later"}])
    assert out["state"] == "FAILED" and out["reason"] == "rank 1: peer lost"


def test_bytes_add_up_times_are_the_slowest_and_every_rank_must_be_verified():
    out = merge_ranks([ok(transfer_ms=2.0), ok(transfer_ms=5.0, verified=False)])
    assert out["bytes"] == 20 and out["transfer_ms"] == 5.0 and out["ranks"] == 2
    assert out["verified"] is False


def test_decode_ranks_that_generated_different_tokens_fail_the_request():
    out = merge_ranks([ok(), ok(output_tokens=[3, 5])])
    assert out["state"] == "FAILED" and "different tokens" in out["reason"]


def test_each_rank_checks_its_own_shard_and_a_failed_check_is_the_instances():
    good = {"token_match": True, "logits_match": True, "max_logit_diff": 0.0}
    bad = {"token_match": True, "logits_match": False, "max_logit_diff": 0.25}
    assert merge_ranks([ok(check=good), ok(check=good)])["check"] == {**good, "ranks_checked": 2}
    out = merge_ranks([ok(check=good), ok(check=good), ok(check=bad)])
    assert out["state"] == "SUCCESS" and out["check"] == {**bad, "ranks_checked": 3, "rank": 2}


def test_prepared_ahead_holds_when_every_rank_that_sent_prepared_its_send():
    sent = {"prepared_ahead": True}
    assert merge_ranks([ok(**sent), ok()])["prepared_ahead"]                # rank 1 fed no decode rank
    assert not merge_ranks([ok(**sent), ok(prepared_ahead=False)])["prepared_ahead"]
    assert not merge_ranks([ok(), ok()])["prepared_ahead"]                  # no rank sent anything
