"""What a decode request holds outside its table, given back in one place: its pool pages (through
the prefix cache where there is one: it keeps the whole pages of a request that ended well, and
lets go of the cached prefix the request took), the staging slots it leased to its senders, and
its place in admission. The table calls free() when it forgets a request (under its lock);
built with those owners, it never calls the server or the table back."""

from disagg.control.admission import Admission
from disagg.decode.requests import DecodeRequest
from kvpool.cache.prefix import PrefixCache
from kvpool.pools.hybrid import HybridPool
from transfer.receiver import KVReceiver


class Release:
    def __init__(self, pool: HybridPool, receiver: KVReceiver, admission: Admission, cache: PrefixCache | None = None):
        self.pool, self.receiver, self.admission, self.cache = pool, receiver, admission, cache

    def free(self, r: DecodeRequest) -> None:
        if r.kv is not None and r.hit is not None:
            self.cache.release(r.kv, r.hit, r.kept)
        elif r.kv is not None:
            self.pool.free_request(r.kv)
        self.receiver.release_slots(r.slots)  # every sender's
        self.admission.released()
