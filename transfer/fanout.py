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
from transfer.sender import KVSender, RemotePool
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

    def send(
        self, src: IndexSet, sends: Sequence[FanOutSend], *, num_tokens: int
    ) -> list[TransferReport | BaseException]:
        """Every receiver's send (fits() must hold); per receiver its report or the error its
        send raised (a TransferError or Cancelled), as KVSender.send would have."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        items = [_Planned(s) for s in sends]
        self._plan(src, items, num_tokens)
        plan_ms = (time.perf_counter() - t0) * 1e3
        live = [p for p in items if p.result is None]
        if live and not self._together(live, t0, cpu0, plan_ms):
            for p in live:  # one by one, as without a fan-out
                p.result = self._alone(src, p.send, num_tokens)
        return [p.result for p in items]

    def _plan(self, src: IndexSet, items: list[_Planned], num_tokens: int) -> None:
        """Each live receiver's plan: the first one planned, the others relaned from it where
        their indices are its receiver's."""
        base: _Planned | None = None
        for p in items:
            s = p.send
            if s.stopped is not None and s.stopped():
                p.result = Cancelled("send stopped: the request was aborted")
                continue
            try:
                if base is not None and s.peer.lanes is not None:
                    tokens = Tokens(num_tokens, s.peer.src_lanes, s.peer.lanes, s.peer.sliced)
                    p.plan = relane(base.plan, base.send.dst, s.dst, s.peer.buffers, tokens)
                p.plan = p.plan or self.sender.plan(s.peer, src, s.dst, num_tokens)
                if base is None:
                    p.plan, base = frozen(p.plan), p  # (its runs shared by the relaned: checked once)
            except TransferError as exc:
                p.result = exc

    def _together(self, live: list[_Planned], t0: float, cpu0: float, plan_ms: float) -> bool:
        """The live receivers' writes as one, and their reports; False (nothing written) where
        they cannot go as one."""
        endpoint = self.sender.endpoint
        own = endpoint.staging.slot_bytes
        for p in live:  # (KVSender.prepare's choice)
            peer = p.send.peer
            slot = min(own, peer.staging.slot_bytes if peer.staging else own)
            stage = KVSender.can_stage(peer, p.send.remote)
            if choose_mode(p.plan, peer.link.cost, endpoint.config, slot, stage) is not Mode.DIRECT:
                return False
        parts = [(p.send.peer.link, _groups(p.plan)) for p in live]
        try:
            prepared = live[0].send.peer.link.fan().prepare(parts)
            prepare_ms = (time.perf_counter() - t0) * 1e3
            if any(p.send.stopped is not None and p.send.stopped() for p in live):
                return False
            for _ in live:
                endpoint.faults.check("send.write")
            first_write, t_submit = time.time(), time.perf_counter()
            writes = prepared.start()
        except (TransferError, ValueError):
            return False
        submit = time.perf_counter() - t_submit
        for p, w in zip(live, writes):
            try:
                w.wait()
            except TransferError as exc:
                p.result = exc
        wait = time.perf_counter() - t_submit - submit
        cpu = (time.thread_time() - cpu0) * 1e3 / len(live)  # (one thread's, shared: merged reports sum it)
        for p in live:
            if p.result is None:
                p.result = _report(
                    p,
                    plan_ms=plan_ms,
                    prepare_ms=prepare_ms,
                    submit=submit,
                    wait=wait,
                    cpu=cpu,
                    first_write=first_write,
                    t0=t0,
                    fanout=len(live),
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


def _report(p: _Planned, *, plan_ms, prepare_ms, submit, wait, cpu, first_write, t0, fanout) -> TransferReport:
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
    )
