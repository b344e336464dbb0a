"""Transports by name: a registry of creators, checked when flags are parsed.

    --transport auto        every transport this machine can run, in preference order
    --transport mooncake    just that one (--mooncake-protocol tcp|rdma picks Mooncake's own)

Per peer, the receiver offers its transports in its order of preference; the sender takes
the first offer one of its own transports can reach (pick) and says which in its reply.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer.errors import TransportError
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, Ranges, Transport

__all__ = ["Exposure", "Link", "LinkCost", "Offer", "PendingWrite", "Ranges", "Transport", "TransportSettings",
           "TRANSPORTS", "create", "pick", "resolve"]


@dataclass(frozen=True)
class TransportSettings:
    """What the transports of one process need to start."""
    host: str = "127.0.0.1"            # bound and advertised
    mooncake_protocol: str = "tcp"     # tcp or rdma
    rdma_devices: str = ""             # NIC names for rdma ("" = all)

    def __post_init__(self) -> None:
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, got {self.mooncake_protocol!r}")


Creator = Callable[[TransportSettings], Transport]


class Registry:
    """name -> creator, in preference order; `auto` entries make up --transport auto."""

    def __init__(self) -> None:
        self._creators: dict[str, tuple[Creator, bool]] = {}

    def add(self, name: str, creator: Creator, auto: bool = True) -> None:
        if name in self._creators or name == "auto":
            raise ValueError(f"transport {name!r} is registered already (or reserved)")
        self._creators[name] = (creator, auto)

    def names(self) -> list[str]:
        return list(self._creators)

    def auto(self) -> list[str]:
        return [n for n, (_, auto) in self._creators.items() if auto]

    def creator(self, name: str) -> Creator:
        try:
            return self._creators[name][0]
        except KeyError:
            raise ValueError(f"unknown transport {name!r}; known: auto, {', '.join(self._creators)}") from None


def _mooncake(s: TransportSettings) -> Transport:
    from transfer.transports.mooncake import MooncakeTransport  # imports mooncake: only when asked for
    return MooncakeTransport(s.host, s.mooncake_protocol, s.rdma_devices)


TRANSPORTS = Registry()
TRANSPORTS.add("mooncake", _mooncake)


def resolve(choice: str) -> tuple[str, ...]:
    """A --transport value -> the transport names it stands for (ValueError if unknown)."""
    if choice == "auto":
        return tuple(TRANSPORTS.auto())
    TRANSPORTS.creator(choice)
    return (choice,)


def create(names: Sequence[str], settings: TransportSettings) -> list[Transport]:
    out = []
    try:
        for name in names:
            out.append(TRANSPORTS.creator(name)(settings))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out


def pick(offers: Sequence[Offer], transports: Sequence[Transport]) -> tuple[Offer, Transport]:
    """The first offer (in the offerer's order of preference) one of `transports` can reach."""
    for offer in offers:
        for t in transports:
            if t.can_reach(offer):
                return offer, t
    raise TransportError(f"no common transport: peer offers {[o.kind for o in offers]}, "
                         f"we have {[t.kind for t in transports]}")
