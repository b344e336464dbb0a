"""The multi-turn workload's parts that need no stack: the conversations it sends (the same in
every run), its flags, and the summary and table made of router answers."""

import argparse

import pytest

from disagg.checks import non_negative_int, token_lengths
from disagg.tools import bench, multiturn
from disagg.tools.runs import Run


def test_every_run_sends_the_same_conversations_and_they_share_the_system_prompt():
    shape = multiturn.Shape(conversations=3, turns=4, system_len=32, user_len="5:9", answer_len=2, seed=7)
    assert shape.system_prompt(100) == shape.system_prompt(100) and len(shape.system_prompt(100)) == 32
    messages = shape.user_messages(1, 100)
    assert messages == shape.user_messages(1, 100) != shape.user_messages(2, 100)
    assert len(messages) == 4 and all(5 <= len(m) <= 9 and max(m) < 100 for m in messages)
    assert multiturn.Shape(1, 1, 0, "3", 1, 0).system_prompt(100) == []


@pytest.mark.parametrize(
    "check, text",
    [
        (token_lengths, "0"),
        (token_lengths, "9:3"),
        (token_lengths, "x"),
        (non_negative_int, "-1"),
        (non_negative_int, "1.5"),
    ],
)
def test_a_bad_length_is_a_one_line_flag_error(check, text):
    with pytest.raises(argparse.ArgumentTypeError):
        check(text)


def test_streaming_both_ways_is_for_the_random_workload_only():
    args = argparse.Namespace(stream_layers="both")
    with pytest.raises(SystemExit, match="with --workload multiturn give on, off or auto"):
        bench.run_multiturn(["http://router"], args)


def answer(
    conversation: int, turn: int, prompt: int, prefix: int, nbytes: int, ok: bool = True, cached: int = 0
) -> dict:
    compute = 2.0 * (prompt - cached) / prompt  # prefill computes what follows its cached prefix
    timings = {"total": 9.0, "prefill": compute, "transfer": nbytes / 1e3, "kv_ready_after_compute": 1.0}
    return {
        "ok": ok,
        "verified": ok,
        "bytes": nbytes if ok else 0,
        "prefix_tokens": prefix,
        "reused_bytes": prefix * 10,
        "prefill_cached_tokens": cached,
        "timings_ms": timings if ok else {},
        "conversation": conversation,
        "turn": turn,
        "prompt_tokens": prompt,
        **({} if ok else {"reason": "decode failed: pool full"}),
    }


def outcome(on_results: list[dict]) -> dict:
    off = [
        {
            **r,
            "prefix_tokens": 0,
            "reused_bytes": 0,
            "prefill_cached_tokens": 0,
            "bytes": r["prompt_tokens"] * 10,
            "timings_ms": {**r["timings_ms"], "prefill": 2.0} if r["ok"] else {},
        }
        for r in on_results
    ]
    runs = {
        label: multiturn.summarize(Run(label, rs, [], 1.0), bench.summarize(rs, 1.0))
        for label, rs in (("reuse_on", on_results), ("reuse_off", off))
    }
    return multiturn.outcome(multiturn.Shape(2, 2, 64, "40", 4, 0), runs)


def test_the_summary_counts_hits_over_prompt_tokens_per_turn_and_in_all():
    out = outcome(
        [
            answer(0, 1, 100, 0, 1000),
            answer(0, 2, 200, 100, 1000, cached=96),
            answer(1, 1, 100, 60, 400, cached=60),
            answer(1, 2, 200, 160, 400, cached=152),
        ]
    )
    on, off = out["runs"]["reuse_on"], out["runs"]["reuse_off"]
    assert on["hit_rate"] == round(320 / 600, 4) and off["hit_rate"] == 0
    assert [t["hit_rate"] for t in on["per_turn"]] == [0.3, 0.65]
    assert on["bytes_per_request"] == 700 and off["bytes_per_request"] == 1500
    assert off["ttft_ms"]["p50"] == 3.0 and on["per_request"][1]["ttft_ms"] == 2.0 * 104 / 200 + 1.0
    assert out["reuse_on_vs_off"]["bytes_fewer_x"] == round(1500 / 700, 2)
    # prefill's own cache: the share of prompt tokens it did not compute, and its compute time
    assert on["prefill_hit_rate"] == round(308 / 600, 4) and off["prefill_hit_rate"] == 0
    assert [t["prefill_hit_rate"] for t in on["per_turn"]] == [0.3, 0.62]
    assert on["per_request"][1]["compute_ms"] == 2.0 * 104 / 200 and off["compute_ms"]["p50"] == 2.0
    assert out["reuse_on_vs_off"]["compute_ms_p50_less_x"] == round(2.0 / on["compute_ms"]["p50"], 2)
    assert multiturn.all_served(out)


def test_the_table_is_aligned_and_a_failed_request_is_left_out_and_named(capsys):
    out = outcome([answer(0, 1, 100, 0, 1000), answer(0, 2, 200, 100, 1000, ok=False)])
    multiturn.print_table(out)
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("turn "))
    rows = [line for line in lines if line.split(" ")[0] in ("1", "2", "all")]
    assert {len(r) for r in rows} == {len(header)}, "\n".join([header, *rows])
    assert rows[1].split("|")[1].split() == ["-"] * len(multiturn.COLUMNS)  # turn 2 failed with reuse on: no figures
    assert "  1 x decode failed: pool full" in lines
    assert not multiturn.all_served(out)


def test_a_second_router_is_for_the_multiturn_workload_only():
    args = argparse.Namespace(plot=None, workload="random", compare_router="http://other", router="http://router")
    with pytest.raises(SystemExit, match="--compare-router runs the multiturn workload"):
        bench.run(args)
