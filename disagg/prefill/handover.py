"""A streamed request's pages go to the RequestTable when the engine starts on them.

    HTTP thread   admit: pages held by the thread --> model.prefill(on_layer=Handover.final)
    engine        layer 0 final --> progress.final(0), then table.streaming(r, kv, progress):
                                    the table holds the pages; a transfer worker starts (once
                                    every destination is here and may_stream agrees)
                  layer i final --> progress.final(i): the worker sends the groups now final

Why at the first layer and not before the engine is called: an engine runs one forward pass
at a time (a real one batches behind one loop), and a transfer worker that streams a request
blocks until that request's layers are final. Handed over early, a request queued behind
others for the engine would hold one of its decode peer's workers all that time, and a
request that computed meanwhile would wait for that worker (tests/disagg/
test_prefill_workers.py has both). Nothing is lost: no layer goes before the first is final.

If the request ended before its first layer (an abort), the table refuses it and the HTTP
thread keeps the pages, as for a request not streamed: computed() frees them when the engine
returns, compute_ended() if it raises (that one decision is the table's, under its lock).
"""

from kvpool import RequestKV
from transfer.progress import LayerProgress


class Handover:
    """One streamed request's on_layer hook (called on the engine's thread)."""

    def __init__(self, table, r, kv: RequestKV, progress: LayerProgress):
        self._table, self._r, self._kv, self.progress = table, r, kv, progress
        self._asked = False

    def final(self, layer: int) -> None:
        """Layer `layer` is final (on a GPU: its kernels are queued; progress records an event)."""
        self.progress.final(layer)
        if not self._asked:
            self._asked = True
            self._table.streaming(self._r, self._kv, self.progress)   # False: r ended (an abort)
