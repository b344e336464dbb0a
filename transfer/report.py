"""TransferReport: what a send did, and the one rule by which reports combine.

One send (KVSender.send) makes one report. A request's KV often moves in several sends that
run at once: one per decode rank a prefill rank feeds, one per prefill rank a decode rank
hears from, one per rank of an instance. Each place that sums them up (prefill per
destination, decode per sender, the router per rank) uses merge(), so a request's numbers
mean the same wherever they are read.

The encoded names are the keys the workers' HTTP answers carry (README, HTTP API): `bytes`,
`transfer_ms`, `layer_groups`, ... A report also travels inside TransferDone (prefill ->
decode), decoded there as untrusted input: counts and times may not be negative.
"""

import functools
from collections.abc import Iterable
from typing import Annotated

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]
Ms = Annotated[float, msgspec.Meta(ge=0.0)]


class TransferReport(msgspec.Struct, frozen=True, kw_only=True):
    """One send's report (KVSender.send: `mode` is then a transfer.config.Mode), or several
    merged (merge: `sends` says how many). Merged reports are of sends that ran at once, so
    amounts add up and durations are the slowest one's."""

    mode: str = ""  # direct | staged; merged: the distinct modes, sorted, joined by "+"
    transport: str = ""  # the link's transport kind; merged: like mode
    nbytes: Count = msgspec.field(default=0, name="bytes")  # bytes moved (body and AUX row); sum
    ranges: Count = 0  # transport ranges submitted (staged: one per chunk, and the AUX row); sum
    chunks: Count = 0  # staged chunks written (0: direct); sum
    groups: Count = msgspec.field(default=1, name="layer_groups")  # layer groups sent, more than
    # one when streamed; max (the request's layers, cut the finest way one send cut them)
    streamed: bool = False  # started before the KV was complete; any
    prepared_ahead: bool = False  # prepare() ran before the send (while the KV was computed); all
    transfer_ms: Ms = 0.0  # ms, wall: the whole send call (planning too unless prepared ahead); max
    plan_ms: Ms = 0.0  # ms: planning (prepared ahead: done before the send was called); max
    prepare_ms: Ms = 0.0  # ms: planning and laying the writes out (prepare()), wherever it ran; max
    submit_ms: Ms = 0.0  # ms, direct: host time handing the writes to the link; max
    wait_ms: Ms = msgspec.field(default=0.0, name="transfer_wait_ms")  # ms, direct: blocked until
    # the link reported the writes landed (streamed: also until their layers were final); max
    cpu_ms: Ms = msgspec.field(default=0.0, name="transfer_cpu_ms")  # ms: CPU time of the sending
    # thread (host work beside a streamed compute); sum (threads of their own)
    after_compute_ms: Ms = 0.0  # ms, wall: how long the send went on after the KV was final (what
    # decode waits for); set by the prefill server, which knows when compute ended; max
    first_write_at: Ms = 0.0  # s, wall clock (time.time) of the first body write, 0: none; the
    # earliest of those that wrote
    end_at: Ms = msgspec.field(default=0.0, name="transfer_end_at")  # s, wall clock (time.time) the
    # send ended, 0: unknown; the latest (where the router's hand-off phase starts: router/phases.py)
    sends: Count = 1  # sends merged into this report; sum
    fanout: Count = 0  # receivers this send was written with as one fan-out (transfer.fanout: one
    # plan, one launch; itself included), 0: it went on its own; max

    def merge(self, other: "TransferReport") -> "TransferReport":
        """Both reports as one: of sends that ran at the same time (see the field comments)."""
        firsts = [t for t in (self.first_write_at, other.first_write_at) if t]
        return TransferReport(
            mode=_joined(self.mode, other.mode),
            transport=_joined(self.transport, other.transport),
            nbytes=self.nbytes + other.nbytes,
            ranges=self.ranges + other.ranges,
            chunks=self.chunks + other.chunks,
            groups=max(self.groups, other.groups),
            streamed=self.streamed or other.streamed,
            prepared_ahead=self.prepared_ahead and other.prepared_ahead,
            transfer_ms=max(self.transfer_ms, other.transfer_ms),
            plan_ms=max(self.plan_ms, other.plan_ms),
            prepare_ms=max(self.prepare_ms, other.prepare_ms),
            submit_ms=max(self.submit_ms, other.submit_ms),
            wait_ms=max(self.wait_ms, other.wait_ms),
            cpu_ms=self.cpu_ms + other.cpu_ms,
            after_compute_ms=max(self.after_compute_ms, other.after_compute_ms),
            first_write_at=min(firsts, default=0.0),
            end_at=max(self.end_at, other.end_at),
            sends=self.sends + other.sends,
            fanout=max(self.fanout, other.fanout),
        )

    def to_dict(self) -> dict:
        """As the workers' HTTP answers carry it (the encoded names; mode as its string)."""
        return msgspec.to_builtins(self)


def merged(reports: Iterable["TransferReport | None"]) -> TransferReport | None:
    """The reports (None: a send that made none) as one; None when there is none."""
    present = [r for r in reports if r is not None]
    return functools.reduce(TransferReport.merge, present) if present else None


def _joined(a: str, b: str) -> str:
    """The distinct non-empty parts of two "+"-joined names, sorted and joined again."""
    return "+".join(sorted({part for name in (a, b) for part in name.split("+") if part}))


REPORT_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(TransferReport))
"""The keys a report spreads into an answer (a reader finds whether an answer carries one)."""
