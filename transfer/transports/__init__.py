"""Transports by name: a registry of the kinds (transfer/transports/kind.py), iterated for the
workers' flags, the --transport choices, `auto` and create(). Adding a transport is its module
(a Transport and its TransportKind) plus one line below.

    --transport auto        every transport that suits this process, in preference order:
                            cuda-ipc (pools on CUDA; peers on the same host), then mooncake
    --transport mooncake    just that one (--mooncake-protocol tcp|rdma picks Mooncake's own)
    --transport cuda-ipc    just that one (pools on CUDA, both processes on one host)
    --transport cma         just that one (CPU pools, both processes on one host:
                            process_vm_writev); never part of auto

Per peer, the receiver offers its transports in its order of preference; the sender takes
the first offer one of its own transports can reach (pick) and says which in its reply.
"""

import argparse
from collections.abc import Iterator, Sequence

from transfer.errors import TransportError
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, PreparedWrite, Transport
from transfer.transports.cma import CMA
from transfer.transports.cuda_ipc import CUDA_IPC
from transfer.transports.kind import TransportKind, TransportSettings
from transfer.transports.mooncake import MOONCAKE
from transfer.transports.ranges import Ranges

__all__ = [
    "Exposure",
    "Link",
    "LinkCost",
    "Offer",
    "PendingWrite",
    "PreparedWrite",
    "Ranges",
    "Transport",
    "TransportKind",
    "TransportSettings",
    "TRANSPORTS",
    "create",
    "pick",
    "resolve",
]


class Registry:
    """The transport kinds by name, in preference order; those that join `auto` and suit a
    process's settings make up its --transport auto."""

    def __init__(self) -> None:
        self._kinds: dict[str, TransportKind] = {}

    def add(self, kind: TransportKind) -> None:
        if kind.name in self._kinds or kind.name == "auto":
            raise ValueError(f"transport {kind.name!r} is registered already (or reserved)")
        self._kinds[kind.name] = kind

    def __iter__(self) -> Iterator[TransportKind]:
        return iter(list(self._kinds.values()))

    def names(self) -> list[str]:
        return list(self._kinds)

    def kind(self, name: str) -> TransportKind:
        try:
            return self._kinds[name]
        except KeyError:
            raise ValueError(f"unknown transport {name!r}; known: auto, {', '.join(self._kinds)}") from None

    def auto(self, settings: TransportSettings) -> list[str]:
        return [k.name for k in self._kinds.values() if k.auto and k.suits(settings)]

    def choices(self) -> list[str]:
        """What --transport takes."""
        return ["auto", *self._kinds]

    def add_flags(self, group) -> None:
        """Every kind's own flags, on an argparse group."""
        for kind in self:
            kind.add_flags(group)

    def own_settings(self, args: argparse.Namespace) -> tuple:
        """Every kind's own settings record, from the flags add_flags added."""
        return tuple(kind.own(args) for kind in self)


TRANSPORTS = Registry()
TRANSPORTS.add(CUDA_IPC)  # (preference order: the first a process suits is offered first)
TRANSPORTS.add(MOONCAKE)
TRANSPORTS.add(CMA)  # (not in auto: disagg.vllm names it for CPU pools, transfer/transports/cma.py)


def resolve(choice: str, settings: TransportSettings | None = None) -> tuple[str, ...]:
    """A --transport value -> the transport names it stands for (ValueError if unknown)."""
    if choice == "auto":
        return tuple(TRANSPORTS.auto(settings or TransportSettings()))
    TRANSPORTS.kind(choice)
    return (choice,)


def create(names: Sequence[str], settings: TransportSettings) -> list[Transport]:
    """The named transports, started with their settings (each kind's own record, or its
    defaults); if one fails to start, those started before it are closed."""
    out = []
    try:
        for name in names:
            out.append(TRANSPORTS.kind(name).start(settings))
    except BaseException:
        for t in out:
            t.close()
        raise
    return out


def pick(offers: Sequence[Offer], transports: Sequence[Transport]) -> tuple[Offer, Transport]:
    """The first offer (in the offerer's order of preference) one of `transports` can reach;
    else TransportError saying why each offer we share a kind with could not be used."""
    why = []
    for offer in offers:
        for t in transports:
            problem = t.reach_problem(offer)
            if problem is None:
                return offer, t
            if t.kind == offer.kind:
                why.append(problem)
    raise TransportError(
        f"no common transport: peer offers {[o.kind for o in offers]}, "
        f"we have {[t.kind for t in transports]}" + (f" ({'; '.join(why)})" if why else "")
    )
