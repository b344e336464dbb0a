"""The answers the router reads and gives: a worker's answer to /prefill or /decode, typed
(read_answer), one instance's answer merged from its ranks' (merge_ranks), and the router's
own answer to /generate (RouterAnswer: the keys README's HTTP API section lists).

A worker's answer comes from the network: read_answer makes anything that is not an answer
(not a JSON object, a field of the wrong type, a negative byte count) a failed one that says
why, never an exception. Keys it does not know are ignored. The transfer report's keys
(transfer/report.py: `bytes`, `mode`, `transfer_ms`, ...) sit flat in the answer, as the
workers have always sent them; they are read into `report`.
"""

from typing import Any, Literal

import msgspec

from transfer.report import REPORT_KEYS, Count, TransferReport, merged


class WorkerAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill or decode worker's answer, or post_json's word for a call that failed."""

    state: str = ""  # SUCCESS; anything else is a failure
    reason: str = ""
    status: int | None = None  # the HTTP status of a refused call (post_json)
    unreachable: bool = False  # the worker could not be reached (post_json)
    first_token: int | None = None  # prefill: the first generated token
    verified: bool | None = None  # decode: every byte of the KV checked
    # decode: the check that found the answer wrong (verify, check; the router's merge: ranks)
    integrity: Literal["verify", "check", "ranks"] | None = None
    output_tokens: list[int] = []  # decode
    check: dict[str, Any] | None = None  # decode: compared with a colocated run (token_match, ...)
    prefill_ms: float | None = None  # ms: prefill's compute
    prefill_done_at: float | None = None  # s, wall clock: prefill's compute ended
    bootstrap_ms: float | None = None  # ms, decode: looking prefill up
    wait_ms: float | None = None  # ms, decode: from its TransferRequests to the KV's arrival
    verify_ms: float | None = None  # ms, decode
    decode_ms: float | None = None  # ms, decode
    rebuild_ms: float | None = None  # ms, decode (a real model's engine)
    check_ms: float | None = None  # ms, decode
    kv_ready_at: float | None = None  # s, wall clock: decode had the whole KV
    ranks: int = 1  # the instance's ranks merged into it
    # prompt positions taken from its prefix cache (decode: not received; prefill: not computed); None: not said
    prefix_tokens: Count | None = None
    reused_bytes: Count | None = None  # decode: KV bytes it did not receive thanks to them
    report: TransferReport | None = None  # what its sends did (None: the answer carries no report)


_SLOWEST = (
    "prefill_ms",
    "prefill_done_at",
    "bootstrap_ms",
    "wait_ms",
    "verify_ms",
    "decode_ms",
    "rebuild_ms",
    "check_ms",
    "kv_ready_at",
)
"""Times of an instance's ranks, which work at once: the instance's is the slowest rank's."""


def failed(reason: str) -> WorkerAnswer:
    return WorkerAnswer(state="FAILED", reason=reason)


def read_answer(raw: object, who: str) -> WorkerAnswer:
    """A worker's decoded JSON answer (post_json's result) as a WorkerAnswer; one that is
    not an answer is a failed one naming `who` and what is wrong with it."""
    if not isinstance(raw, dict):
        return failed(f"{who} gave a malformed answer: a JSON {type(raw).__name__}, not an object")
    try:
        answer = msgspec.convert({k: v for k, v in raw.items() if k != "report"}, WorkerAnswer)
        report = msgspec.convert(raw, TransferReport) if REPORT_KEYS & raw.keys() else None
    except msgspec.ValidationError as exc:
        return failed(f"{who} gave a malformed answer: {exc}")
    return msgspec.structs.replace(answer, report=report)


def merge_ranks(outs: list[WorkerAnswer], role: str = "decode") -> WorkerAnswer:
    """One instance's answer from its ranks' answers: the first failure if any rank failed (its
    reason, which stays first (the metrics' label), naming the role's rank); else rank 0's, with the reports merged (TransferReport.merge),
    times the slowest rank's (the ranks work at once). Decode ranks must agree on the tokens
    they generated: ranks that differ make the answer wrong (integrity "ranks", HTTP 500). Every
    rank's check is kept (_check), whichever rank speaks for the instance."""
    if len(outs) == 1:
        return outs[0]
    check = _check(outs)
    for rank, out in enumerate(outs):
        if out.state != "SUCCESS":
            return msgspec.structs.replace(out, reason=f"{out.reason} ({role} rank {rank})", check=check)
    tokens = [out.output_tokens for out in outs]
    odd = [rank for rank, t in enumerate(tokens) if t != tokens[0]]
    if odd:
        return msgspec.structs.replace(
            outs[0],
            state="FAILED",
            integrity="ranks",
            check=check,
            reason=f"ranks differ: decode rank {', '.join(map(str, odd))} generated other tokens than rank 0: {tokens}"[
                :500
            ],
        )
    slowest = {}
    for name in _SLOWEST:
        values = [getattr(out, name) for out in outs if getattr(out, name) is not None]
        if values:
            slowest[name] = max(values)
    return msgspec.structs.replace(
        outs[0],
        **slowest,
        **_reused(outs),
        ranks=len(outs),
        report=merged(out.report for out in outs),
        check=check,
        verified=all(out.verified for out in outs) if outs[0].verified is not None else None,
    )


def _reused(outs: list[WorkerAnswer]) -> dict:
    """What an instance's ranks reused of their prefix caches. Each rank keeps its own
    cache and may hit differently: the bytes not received add up (like the bytes moved), and the
    instance reused the prompt positions that every rank held (the fewest), so that
    prefix_tokens / prompt_tokens is a hit rate at any TP."""
    said = [out for out in outs if out.prefix_tokens is not None]
    if not said:
        return {}
    return {
        "prefix_tokens": min(out.prefix_tokens for out in said),
        "reused_bytes": sum(out.reused_bytes or 0 for out in said),
    }


def _check(outs: list[WorkerAnswer]) -> dict | None:
    """Each decode rank checks its own shard. The instance's check: the first failed rank's
    (else the first checked rank's) fields, with every rank's own (`per_rank`, null where a
    rank made none), the ranks whose check failed (`failed_ranks`; `rank`: the first) and how
    many checked."""
    checks = [out.check for out in outs]
    if all(c is None for c in checks):
        return None
    bad = [
        r for r, c in enumerate(checks) if c is not None and not (c.get("token_match") and c.get("logits_match", True))
    ]
    first = checks[bad[0]] if bad else next(c for c in checks if c is not None)
    return {
        **first,
        "ranks_checked": sum(c is not None for c in checks),
        "failed_ranks": bad,
        **({"rank": bad[0]} if bad else {}),
        "per_rank": checks,
    }


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """The router's `timings_ms`: each phase in ms, null where the request did not get there."""

    bootstrap: float | None
    prefill: float | None
    transfer: float | None
    transfer_cpu: float | None
    wait: float | None
    verify: float | None
    decode: float | None
    rebuild: float | None
    check: float | None
    control: float | None  # prefill done -> KV ready on decode, minus the send's own time
    kv_ready_after_compute: float | None  # prefill done -> KV ready on decode
    total: float


class RouterAnswer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The router's answer to /generate (the fields with a default are left out when unset)."""

    room: int
    pair: int
    ok: bool
    status: int
    prompt_tokens: int
    output_tokens: list[int]
    verified: bool
    check: dict[str, Any] | None = None  # decode's check, when one was made
    nbytes: int = msgspec.field(name="bytes")  # bytes the KV took (decode's count)
    # decode's prefix cache: prompt positions every decode rank already held (moved from there on),
    # and the KV bytes that did not move thanks to them, all ranks; left out where decode said nothing
    prefix_tokens: int | None = None
    reused_bytes: int | None = None
    # prefill's prefix cache: prompt positions every prefill rank had cached and did not compute;
    # left out where prefill said nothing (its cache off)
    prefill_cached_tokens: int | None = None
    # what the router's index predicted of it when it chose the pair (--route kv; left out where it
    # had no copy of that prefill's cache): beside prefill_cached_tokens, how well it routes
    prefill_cached_predicted: int | None = None
    mode: str | None
    transport: str | None
    streamed: bool
    layer_groups: int | None
    prepared_ahead: bool  # the send was planned and laid out while the prompt was computed
    # the most decode ranks one prefill rank wrote as one fan-out (transfer.fanout: one plan, one
    # write into all of them); left out where every send went on its own
    fanout: int = 0
    # streamed: how long before the engine's last layer the first KV write went out
    first_write_before_compute_end_ms: float | None = None
    reason: str
    timings_ms: Timings

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)
