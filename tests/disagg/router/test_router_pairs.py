"""How the router merges the answers of an instance's ranks into one (router/answers.merge_ranks),
each read as the router reads a worker's JSON answer (read_answer)."""

from disagg.router.answers import merge_ranks, read_answer


def ok(**more):
    """A rank's successful answer; one with transfer keys (`bytes`, ...) reports a send."""
    return read_answer({"state": "SUCCESS", "output_tokens": [3, 4], "verified": True, **more}, "decode")


def sent(**more):
    return ok(**{"bytes": 10, "transfer_ms": 1.0, **more})


def test_one_rank_is_its_own_answer():
    assert merge_ranks([sent(bytes=7)]) == sent(bytes=7)


def test_the_first_failed_rank_speaks_and_is_named():
    out = merge_ranks(
        [
            sent(),
            read_answer({"state": "FAILED", "reason": "peer lost"}, "decode rank 1"),
            read_answer({"state": "FAILED", "reason": "later"}, "decode rank 2"),
        ]
    )
    assert out.state == "FAILED" and out.reason == "peer lost (decode rank 1)"
    out = merge_ranks([sent(), read_answer({"state": "FAILED", "reason": "compute failed"}, "prefill")], "prefill")
    assert out.reason == "compute failed (prefill rank 1)"


def test_bytes_add_up_times_are_the_slowest_and_every_rank_must_be_verified():
    out = merge_ranks([sent(transfer_ms=2.0, wait_ms=3.0), sent(transfer_ms=5.0, wait_ms=1.0, verified=False)])
    assert out.report.nbytes == 20 and out.report.transfer_ms == 5.0 and out.ranks == 2 and out.wait_ms == 3.0
    assert out.verified is False


def test_decode_ranks_that_generated_different_tokens_fail_the_request_and_are_named():
    out = merge_ranks([sent(), sent(), sent(output_tokens=[3, 5])])
    assert out.state == "FAILED" and out.integrity == "ranks"
    assert out.reason.startswith("ranks differ: decode rank 2 generated other tokens than rank 0: "), out.reason


def test_each_rank_checks_its_own_shard_and_a_failed_check_is_the_instances():
    good = {"token_match": True, "logits_match": True, "max_logit_diff": 0.0}
    bad = {"token_match": True, "logits_match": False, "max_logit_diff": 0.25}
    assert merge_ranks([sent(check=good), sent(check=good)]).check == {
        **good,
        "ranks_checked": 2,
        "failed_ranks": [],
        "per_rank": [good, good],
    }
    out = merge_ranks([sent(check=good), sent(), sent(check=bad)])
    assert out.state == "SUCCESS" and out.check == {
        **bad,
        "ranks_checked": 2,
        "failed_ranks": [2],
        "rank": 2,
        "per_rank": [good, None, bad],
    }


def test_every_ranks_check_is_kept_whichever_rank_speaks():
    """Rank 1's check failed (decode failed the request there): its failure speaks for the
    instance, and rank 0's passing check is reported beside it, not instead of it."""
    good = {"token_match": True, "logits_match": True, "max_logit_diff": 0.0}
    bad = {"token_match": False, "first_mismatch": 1, "logits_match": False, "max_logit_diff": 3.5}
    failed = read_answer(
        {"state": "FAILED", "integrity": "check", "reason": "check: differs", "check": bad, "output_tokens": [3, 9]},
        "decode rank 1",
    )
    out = merge_ranks([sent(check=good), failed])
    assert out.state == "FAILED" and out.integrity == "check" and out.reason == "check: differs (decode rank 1)"
    assert out.check["failed_ranks"] == [1] and out.check["per_rank"] == [good, bad] and not out.check["token_match"]


def test_prepared_ahead_holds_when_every_rank_that_sent_prepared_its_send():
    assert merge_ranks([sent(prepared_ahead=True), ok()]).report.prepared_ahead  # rank 1 fed no decode rank
    assert not merge_ranks([sent(prepared_ahead=True), sent(prepared_ahead=False)]).report.prepared_ahead
    assert merge_ranks([ok(), ok()]).report is None  # no rank sent anything


def test_the_ranks_reports_merge_by_the_one_rule():
    out = merge_ranks(
        [
            sent(mode="direct", first_write_at=5.0, streamed=True, layer_groups=4),
            sent(mode="staged", first_write_at=4.0, layer_groups=6),
        ]
    )
    assert out.report.mode == "direct+staged" and out.report.first_write_at == 4.0
    assert out.report.streamed and out.report.groups == 6 and out.report.sends == 2


def test_a_worker_answer_that_is_not_one_is_a_failed_answer_naming_the_worker():
    for raw, says in (
        ([1], "a JSON list, not an object"),
        ("ok", "a JSON str, not an object"),
        ({"state": "SUCCESS", "output_tokens": "3 4"}, "Expected `array`, got `str`"),
        ({"state": "SUCCESS", "bytes": -5}, "Expected `int` >= 0"),
        ({"state": 1}, "Expected `str`, got `int`"),
    ):
        out = read_answer(raw, "decode rank 1")
        assert out.state == "FAILED" and out.reason.startswith("decode rank 1 gave a malformed answer: ")
        assert says in out.reason, out.reason
    assert read_answer({"state": "SUCCESS", "unknown": {"x": 1}, "report": "?"}, "decode").state == "SUCCESS"


def test_what_decode_reused_adds_up_in_bytes_and_counts_the_positions_every_rank_held():
    """Each decode rank reports its own cache hit: bytes it did not receive add up like the
    bytes moved; the prompt positions the instance reused are those every rank held."""
    out = merge_ranks([sent(prefix_tokens=96, reused_bytes=300), sent(prefix_tokens=64, reused_bytes=200)])
    assert out.prefix_tokens == 64 and out.reused_bytes == 500 and out.report.nbytes == 20
    assert merge_ranks([ok(), ok()]).prefix_tokens is None  # decode said nothing (vLLM's)
    bad = read_answer({"state": "SUCCESS", "prefix_tokens": -16}, "decode rank 1")
    assert bad.state == "FAILED" and "Expected `int` >= 0" in bad.reason, bad.reason
