"""POST /cache/events, one route for every role that keeps a prefix cache (decode: what it need
not receive; prefill: what it need not compute): what the cache holds, by chained page key,
for the router's index (disagg/router/cache_index.py), as the changes since the caller's last
look or, when it has none or names another epoch, everything.

One code path for both roles, so the router reads a prefill's cache exactly as a decode's
(the answer is disagg/control/cache_events.py's CacheEvents either way).
"""

from disagg.control.cache_events import CacheEvents, encode_events
from disagg.errors import BadRequest
from kvpool.cache.prefix import PrefixCache


class CacheEventsRoute:
    def __init__(self, cache: PrefixCache, epoch: int):
        self.cache, self.epoch = cache, epoch

    def __call__(self, body: dict) -> dict:
        """{"since": the seq of the caller's last answer, or null; "epoch": that answer's}: the
        cache's changes since then, or all of it ("reset": true) when the caller has none or its
        epoch is not ours (we restarted: our seq counts another journal)."""
        since, epoch = body.get("since"), body.get("epoch")
        if since is not None and (type(since) is not int or since < 0):
            raise BadRequest("since must be null or a non-negative int (the seq of your last answer)")
        if epoch != self.epoch:
            since = None
        return encode_events(CacheEvents(epoch=self.epoch, **self.cache.published(since)))


def cache_routes(cache: "PrefixCache | None", epoch: int) -> dict:
    """{"/cache/events": its route} for a worker with a prefix cache, {} for one without (404)."""
    return {"/cache/events": CacheEventsRoute(cache, epoch)} if cache is not None else {}
