"""What a decode request holds outside its table, given back in one place: its pool pages, the
staging slots it leased to its senders, and its place in admission. The table calls free()
when it forgets a request (under its lock); built with those three owners, it never calls the
server or the table back."""

from disagg.control.admission import Admission
from disagg.decode.requests import DecodeRequest
from kvpool.pools.hybrid import HybridPool
from transfer.receiver import KVReceiver


class Release:
    def __init__(self, pool: HybridPool, receiver: KVReceiver, admission: Admission):
        self.pool, self.receiver, self.admission = pool, receiver, admission

    def free(self, r: DecodeRequest) -> None:
        if r.kv is not None:
            self.pool.free_request(r.kv)
        self.receiver.release_slots(r.slots)   # every sender's
        self.admission.released()
