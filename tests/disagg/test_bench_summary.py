"""bench's summary of checked generations (what `disagg demo` and `disagg bench` exit on)."""

from disagg.tools.bench import mismatches, summarize


def test_bench_counts_a_checked_generation_that_differs_as_a_failure():
    """The demo's and bench's exit code: a logits-only difference counts, like a token one."""
    same = {"token_match": True, "logits_match": True}
    results = [{"ok": True, "verified": True, "bytes": 1, "timings_ms": {"total": 1.0}, "check": c}
               for c in (same, same, {"token_match": True, "logits_match": False}, None)]
    summary = summarize(results, 1.0)
    assert summary["token_match"] == {"checked": 3, "match": 3, "logits_match": 2}
    assert mismatches(summary) == 1
    assert mismatches(summarize(results[:2], 1.0)) == 0


def test_failure_reasons_are_kept_whole_and_grouped():
    why = "decode failed: prefill layout differs: " + "x" * 300 + " (head_dim x kv_heads: prefill 64x8, decode 64x12)"
    summary = summarize([{"ok": False, "reason": why}, {"ok": False, "reason": why}, {"status": 503, "error": "busy"}], 1.0)
    assert summary["failures"] == {why: 2, "busy": 1} and summary["failed"] == 3
