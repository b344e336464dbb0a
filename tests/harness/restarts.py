"""A sender and peers on a dead one's ports, one peer after another (run inside a network
namespace that keeps no TIME_WAIT: tests/transfer/test_restarted_peers.py). Each peer gets
exactly two adjacent ports (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), taking one for its session and
the other for data either way round; they are chosen to reuse the last peer's in a way not
met yet, until every kind was. Every peer gets two requests written and checked byte for
byte: first one of two ranges (which meets whatever connections the last peer left pooled:
one stale connection each may fail it), then one of many ranges at once (which leaves every
pooled connection to this peer, for the next one to meet). Prints {"met": {kind: count}, "engines": the sender's engines at the end} as JSON.

    python -m harness.restarts
"""

import collections
import json
import os

import msgspec

from harness.peer_client import PeerProcess
from harness.source import send_checked, source_pool
from kvpool import Layout
from transfer.config import Mode
from transfer.transports import TransportSettings, create
from transfer.transports.mooncake import MooncakeSettings

FIRST_PORT = 17150  # peers' ports: outside the sender's range (Mooncake's default, 15000-17000)
SAME = "the same session and data port"
NEW_SESSION = "a new session on the dead one's data port"
NEW_DATA = "the same session on a new data port"
KINDS = (SAME, NEW_SESSION, NEW_DATA)


def ports_for(kind: str | None, last: tuple[int, int] | None) -> tuple[int, int]:
    """Two adjacent ports for the next peer, so that half the time it meets `kind`."""
    if last is None:
        return FIRST_PORT, FIRST_PORT + 1
    session, data = last
    if kind == NEW_SESSION:
        return tuple(sorted((data, 2 * data - session)))
    if kind == NEW_DATA:
        return tuple(sorted((session, 2 * session - data)))
    return tuple(sorted(last))


def kind_of(now: tuple[int, int], last: tuple[int, int] | None) -> str | None:
    """Which reuse (session port, data port) `now` makes of `last` (None: none)."""
    if last is None or now[0] != last[0] and now[1] != last[1]:
        return None
    return SAME if now == last else NEW_SESSION if now[1] == last[1] else NEW_DATA


def incarnations(sender, limit: int = 40) -> collections.Counter:
    met: collections.Counter = collections.Counter()
    last = None
    for _ in range(limit):
        todo = [k for k in KINDS if not met[k]]
        if not todo:
            break
        low, high = ports_for(todo[0], last)
        env = dict(os.environ, MC_MIN_RPC_PORT=str(low), MC_MAX_RPC_PORT=str(high))
        with PeerProcess("tiny-hybrid", 4, 4096, env=env, flags=("--mooncake-engines", "1")) as peer:
            small = source_pool(peer, "tiny-full", 4, Layout.PAGE_MAJOR, fragment=False)
            session = int(msgspec.msgpack.decode(peer.target().offers[0].blob)[0].rpartition(":")[2])
            now = (session, high if session == low else low)
            send_checked(sender, peer, small, 8, Mode.DIRECT)  # two ranges, on the connections kept
            pool = source_pool(peer, "tiny-hybrid", 4, Layout.PAGE_MAJOR)
            send_checked(sender, peer, pool, 301, Mode.DIRECT)  # many at once: every pooled connection
        met[kind_of(now, last)] += 1
        last = now
    return met


def main() -> None:
    [sender] = create(["mooncake"], TransportSettings("127.0.0.1", own=(MooncakeSettings(engines=1),)))
    met = incarnations(sender)
    print(json.dumps({"met": {str(k): n for k, n in met.items()}, "engines": len(sender.engines)}))
    sender.close()


if __name__ == "__main__":
    main()
