"""Which ranks of a prefill instance one decode rank receives from, and the lanes each one's
staged pieces name (both pure functions of the model and the two shards, cached).

    prefill TP N, decode TP M, we are decode rank s:
      N == M   -> prefill rank s only (it holds exactly our heads)
      N != M   -> every prefill rank t that holds some unit we hold
                  (transfer.reshard.sends; replicated units from one holder each)

The ranks change only when the prefill instance's TP size does; the lanes also with its page
size.
"""

from disagg.control.messages import RegisterPrefill
from disagg.errors import ProtocolError
from kvpool.errors import SpecError
from transfer.errors import LayoutIncompatible
from transfer.receiver import KVReceiver
from transfer.reshard import Lanes, Shard, peer_shard, senders


class SenderRanks:
    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        cfg = receiver.endpoint.pool.config
        self.own = cfg.shard
        self._ranks: dict[int, tuple[int, ...]] = {}  # prefill TP size -> the ranks we receive from
        self._lanes: dict[Shard, Lanes | None] = {}

    def sender_ranks(self, rank0: RegisterPrefill) -> tuple[int, ...]:
        """The prefill ranks we receive from, given rank 0's registration (its TP size stands for
        the instance's); ProtocolError if that TP size cannot split our model."""
        ranks = self._ranks.get(rank0.tp_size)
        if ranks is None:
            cfg = self.receiver.endpoint.pool.config
            try:
                ranks = senders(cfg.model, rank0.tp_size, self.own, tuple(cfg.components))
            except (SpecError, LayoutIncompatible) as exc:
                raise ProtocolError(
                    f"a prefill instance of TP size {rank0.tp_size} cannot send to ours "
                    f"(rank {self.own.tp_rank} of {self.own.tp_size}): {exc}"
                ) from None
            self._ranks[rank0.tp_size] = ranks
        return ranks

    def lanes(self, info: RegisterPrefill) -> Lanes | None:
        """Our side of the lanes prefill rank `info` writes by (None: whole pages)."""
        try:
            shard = peer_shard(info.layout.page_size, info.tp_size, info.tp_rank, whose="prefill's", own=self.own)
            if shard not in self._lanes:
                self._lanes[shard] = self.receiver.lanes_from(shard)
        except LayoutIncompatible as exc:
            raise ProtocolError(str(exc)) from None
        return self._lanes[shard]
