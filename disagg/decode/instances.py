"""Which ranks of a prefill instance one decode rank receives from, and the lanes each one's
staged pieces name (both pure functions of the model and the two shards, cached).

    prefill TP N, decode TP M, we are decode rank s:
      N == M   -> prefill rank s only (it holds exactly our heads)
      N != M   -> every prefill rank t that holds some unit we hold
                  (transfer.reshard.sends; replicated units from one holder each)

The answer changes only when the prefill instance does (another TP size or page size).
"""

from disagg.control.messages import RegisterPrefill
from disagg.errors import ProtocolError
from kvpool.errors import SpecError
from transfer.errors import LayoutIncompatible
from transfer.receiver import KVReceiver
from transfer.reshard import Lanes, Shard, sends


class SenderRanks:
    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        cfg = receiver.pool.config
        self.own = Shard(cfg.page_size, cfg.tp_size, cfg.tp_rank)
        self._ranks: dict[tuple[int, int], tuple[int, ...]] = {}   # (TP size, page size) -> ranks
        self._lanes: dict[Shard, Lanes | None] = {}

    def sender_ranks(self, rank0: RegisterPrefill) -> tuple[int, ...]:
        """The prefill ranks we receive from, given rank 0's registration (its TP size and page
        size stand for the instance's); ProtocolError if that TP size cannot split our model."""
        key = (rank0.tp_size, rank0.layout.page_size)
        ranks = self._ranks.get(key)
        if ranks is None:
            cfg = self.receiver.pool.config
            try:
                ranks = tuple(t for t in range(rank0.tp_size)
                              if sends(cfg.model, Shard(key[1], key[0], t), self.own, tuple(cfg.components)))
            except (SpecError, LayoutIncompatible) as exc:
                raise ProtocolError(f"a prefill instance of TP size {rank0.tp_size} cannot send to ours "
                                    f"(rank {self.own.tp_rank} of {self.own.tp_size}): {exc}") from None
            self._ranks[key] = ranks
        return ranks

    def lanes(self, info: RegisterPrefill) -> Lanes | None:
        """Our side of the lanes prefill rank `info` writes by (None: whole pages)."""
        shard = Shard(info.layout.page_size, info.tp_size, info.tp_rank)
        if shard not in self._lanes:
            try:
                self._lanes[shard] = self.receiver.lanes_from(shard)
            except LayoutIncompatible as exc:
                raise ProtocolError(str(exc)) from None
        return self._lanes[shard]
