"""One request's send from this prefill rank into several receivers at once (a fan-out: TP 1 ->
8, one rank's pages into every decode rank), planned once and written as one, where each send
alone planned, laid out, launched and waited for itself: on one H100 ~1 ms of host time per
send, eight in turn under one GIL (4x the 1 -> 1 transfer of the same bytes).

    plan the first receiver's send; every other receiver whose indices are the same (decode
    ranks of one instance allocate alike) gets the same runs with its own lanes
    (transfer.plan.relane), a receiver that differs is planned on its own
    -> one write of every receiver's runsets (Link.fan: cuda-ipc merges the lanes of runs they
       share into one launch, each peer's ranges checked against that peer's regions)
    -> started once every receiver is still live; one wait; a report per receiver

Per receiver semantics are those of KVSender.send: a receiver whose request was aborted
(stopped) before the write is Cancelled, one that fails to plan gets its own error. Whenever
the fan-out cannot go as one (a receiver aborted or failing, a link closed, a peer's range
outside its regions, a send that would go staged), each remaining receiver is sent on its own,
one after the other, through KVSender.send, as without a fan-out, and gets that send's result.
A report of the fan-out's one write names its receivers (TransferReport.fanout).

Its callers: the prefill worker, for a computed request's decode ranks where their links fit
(disagg/prefill/jobs.py: one job instead of one per destination on each peer's shard), and
the test harness's sender processes (bench_tp's 1:8 row).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.indices import IndexSet
from transfer.config import Mode
from transfer.cost import choose_mode
from transfer.errors import Cancelled, TransferError
from transfer.plan import TransferPlan, frozen, relane
from transfer.report import TransferReport
from transfer.sender import KVSender, RemotePool, same_indices
from transfer.staging import RemoteSlots
from transfer.tokens import Tokens


@dataclass(frozen=True)
class FanOutSend:
    """One receiver of a fan-out: as KVSender.send's arguments."""

    peer: RemotePool
    dst: IndexSet
    remote: RemoteSlots | None = None
    stopped: Callable[[], bool] | None = None


@dataclass
class _Planned:
    send: FanOutSend
    plan: TransferPlan | None = None
    result: TransferReport | BaseException | None = None  # set: this receiver is settled


@dataclass(eq=False)
class PreparedFan:
    """A fan-out laid out before its KV is final (FanOut.prepare: every receiver planned, the
    one write's table laid out and uploaded; nothing moved), so that send(prepared=) only
    starts the write once the engine is done, as KVSender.prepare does for one receiver. One
    send uses it; dropped unused, its table goes back."""

    src: IndexSet
    sends: tuple[FanOutSend, ...]
    num_tokens: int
    items: list[_Planned]  # per receiver: its plan, or the error planning it raised
    fan: object | None  # the one write laid out (Link.fan().prepare); None: they cannot go as one
    plan_ms: float
    prepare_ms: float
    used: bool = False

    def fits(self, src: IndexSet, sends: Sequence[FanOutSend], num_tokens: int) -> bool:
        """Whether it is this fan-out's: not used, same length, source indices and receivers
        (each the same peer link and destination indices, in order)."""
        return (
            not self.used
            and self.num_tokens == num_tokens
            and len(sends) == len(self.sends)
            and same_indices(self.src, src)
            and all(a.peer is b.peer and same_indices(a.dst, b.dst) for a, b in zip(self.sends, sends))
        )


class FanOut:
    """Fan-outs of `sender` (its endpoint's pool and transports)."""

    def __init__(self, sender: KVSender):
        self.sender = sender

    @staticmethod
    def fits(sends: Sequence[FanOutSend]) -> bool:
        """Whether these sends can go as one: several, over links of one transport that fans
        out (Link.fan), each link once."""
        fans = [s.peer.link.fan() for s in sends]
        return (
            len(sends) > 1
            and fans[0] is not None
            and all(f is fans[0] for f in fans)
            and len({id(s.peer.link) for s in sends}) == len(sends)
        )

    def prepare(self, src: IndexSet, sends: Sequence[FanOutSend], num_tokens: int) -> PreparedFan:
        """Every receiver planned (the first one, the others relaned from it where they can
        be) and, where all that planned go direct, their one write laid out; moves no byte,
        so it may run while the engine computes. A receiver whose plan fails keeps its error."""
        t0 = time.perf_counter()
        items = [_Planned(s) for s in sends]
        self._plan(src, items, num_tokens)
        plan_ms = (time.perf_counter() - t0) * 1e3
        live = [p for p in items if p.result is None]
        fan = self._lay_out(live) if live else None
        prepare_ms = (time.perf_counter() - t0) * 1e3
        return PreparedFan(src, tuple(sends), num_tokens, items, fan, plan_ms, prepare_ms)

    def send(
        self, src: IndexSet, sends: Sequence[FanOutSend], *, num_tokens: int, prepared: PreparedFan | None = None
    ) -> list[TransferReport | BaseException]:
        """Every receiver's send (fits() must hold); per receiver its report or the error its
        send raised (a TransferError or Cancelled), as KVSender.send would have. `prepared`:
        this fan-out prepared ahead (prepare() with the same source, receivers and length, not
        used before); anything else is planned here."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if all(s.stopped is not None and s.stopped() for s in sends):  # aborted while queued: not even planned
            return [Cancelled("send stopped: the request was aborted") for _ in sends]
        ahead = prepared is not None and prepared.fits(src, sends, num_tokens)
        p = prepared if ahead else self.prepare(src, sends, num_tokens)
        p.used = True
        items = [_Planned(s, it.plan, it.result) for s, it in zip(sends, p.items)]
        for it in items:  # (asked again before the write, in _together)
            if it.result is None and it.send.stopped is not None and it.send.stopped():
                it.result = Cancelled("send stopped: the request was aborted")
        live = [it for it in items if it.result is None]
        laid_out = sum(it.result is None for it in p.items)  # (the receivers its write covers)
        fan, p.fan = p.fan, None
        if live and not (fan is not None and len(live) == laid_out and self._together(live, fan, t0, cpu0, p, ahead)):
            for it in live:  # one by one, as without a fan-out
                it.result = self._alone(src, it.send, num_tokens)
        return [it.result for it in items]

    def _plan(self, src: IndexSet, items: list[_Planned], num_tokens: int) -> None:
        """Each receiver's plan: the first one planned, the others relaned from it where their
        indices are its receiver's."""
        base: _Planned | None = None
        for p in items:
            s = p.send
            try:
                if base is not None and s.peer.lanes is not None:
                    tokens = Tokens(num_tokens, s.peer.src_lanes, s.peer.lanes, s.peer.sliced)
                    p.plan = relane(base.plan, base.send.dst, s.dst, s.peer.buffers, tokens)
                p.plan = p.plan or self.sender.plan(s.peer, src, s.dst, num_tokens)
                if base is None:
                    p.plan, base = frozen(p.plan), p  # (its runs shared by the relaned: checked once)
            except TransferError as exc:
                p.result = exc

    def _lay_out(self, live: list[_Planned]):
        """The live receivers' one write laid out (Link.fan().prepare), or None where they
        cannot go as one: one that would not go direct, a link closed, a range outside its
        receiver's regions (each then goes alone, and its own send says what is wrong)."""
        endpoint = self.sender.endpoint
        own = endpoint.staging.slot_bytes
        for p in live:  # (KVSender.prepare's choice)
            peer = p.send.peer
            slot = min(own, peer.staging.slot_bytes if peer.staging else own)
            stage = KVSender.can_stage(peer, p.send.remote)
            if choose_mode(p.plan, peer.link.cost, endpoint.config, slot, stage) is not Mode.DIRECT:
                return None
        try:
            return live[0].send.peer.link.fan().prepare([(p.send.peer.link, _groups(p.plan)) for p in live])
        except (TransferError, ValueError):
            return None

    def _together(self, live: list[_Planned], fan, t0: float, cpu0: float, p: PreparedFan, ahead: bool) -> bool:
        """The live receivers' one write (`fan`, laid out for exactly them) started and waited
        for, and their reports; False (nothing written) where it cannot start."""
        endpoint = self.sender.endpoint
        try:
            if any(it.send.stopped is not None and it.send.stopped() for it in live):
                return False
            for _ in live:
                endpoint.faults.check("send.write")
            first_write, t_submit = time.time(), time.perf_counter()
            writes = fan.start()
        except (TransferError, ValueError):
            return False
        submit = time.perf_counter() - t_submit
        for it, w in zip(live, writes):
            try:
                w.wait()
            except TransferError as exc:
                it.result = exc
        wait = time.perf_counter() - t_submit - submit
        cpu = (time.thread_time() - cpu0) * 1e3 / len(live)  # (one thread's, shared: merged reports sum it)
        for it in live:
            if it.result is None:
                it.result = _report(
                    it,
                    plan_ms=p.plan_ms,
                    prepare_ms=p.prepare_ms,
                    submit=submit,
                    wait=wait,
                    cpu=cpu,
                    first_write=first_write,
                    t0=t0,
                    fanout=len(live),
                    ahead=ahead,
                )
        return True

    def _alone(self, src: IndexSet, s: FanOutSend, num_tokens: int) -> TransferReport | BaseException:
        try:
            return self.sender.send(s.peer, src, s.dst, s.remote, num_tokens=num_tokens, stopped=s.stopped)
        except (TransferError, Cancelled) as exc:
            return exc


def _groups(plan: TransferPlan) -> list[list]:
    """A direct send's groups of runsets: the body, then its AUX row (KVSender.prepare's chain)."""
    body = [c.runset for c in plan.body]
    return [body, [plan.aux.runset]] if plan.aux is not None else [body]


def _report(p: _Planned, *, plan_ms, prepare_ms, submit, wait, cpu, first_write, t0, fanout, ahead) -> TransferReport:
    peer, plan = p.send.peer, p.plan
    return TransferReport(
        mode=Mode.DIRECT,
        transport=peer.link.kind,
        nbytes=plan.nbytes,
        ranges=plan.num_ranges,
        groups=1,
        transfer_ms=(time.perf_counter() - t0) * 1e3,
        plan_ms=plan_ms,
        prepare_ms=prepare_ms,
        submit_ms=submit * 1e3,
        wait_ms=wait * 1e3,
        cpu_ms=cpu,
        first_write_at=first_write,
        end_at=time.time(),
        fanout=fanout,
        prepared_ahead=ahead,
    )
