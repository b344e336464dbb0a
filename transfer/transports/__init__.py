"""Transports by name: a registry of creators, checked when flags are parsed.

    --transport auto        every transport that suits this process, in preference order:
                            cuda-ipc (pools on CUDA; peers on the same host), then mooncake
    --transport mooncake    just that one (--mooncake-protocol tcp|rdma picks Mooncake's own)
    --transport cuda-ipc    just that one (pools on CUDA, both processes on one host)

Per peer, the receiver offers its transports in its order of preference; the sender takes
the first offer one of its own transports can reach (pick) and says which in its reply.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer.errors import TransportError
from transfer.transports.base import Exposure, Link, LinkCost, Offer, PendingWrite, PreparedWrite, Transport
from transfer.transports.ranges import Ranges

__all__ = ["Exposure", "Link", "LinkCost", "Offer", "PendingWrite", "PreparedWrite", "Ranges", "Transport",
           "TransportSettings", "TRANSPORTS", "create", "pick", "resolve"]


@dataclass(frozen=True)
class TransportSettings:
    """What the transports of one process need to start."""
    host: str = "127.0.0.1"            # bound and advertised
    mooncake_protocol: str = "tcp"     # tcp or rdma
    rdma_devices: str = ""             # NIC names for rdma ("" = all)
    device: str = "cpu"                # where the pool lives: cpu, cuda, cuda:N
    cuda_ipc_blocks: int = 32          # SMs' worth of blocks the copy kernel takes

    @property
    def cuda_index(self) -> int | None:
        """The CUDA device index the pool is on (None: not on CUDA)."""
        if not self.device.startswith("cuda"):
            return None
        _, _, index = self.device.partition(":")
        return int(index) if index else None

    def __post_init__(self) -> None:
        if self.mooncake_protocol not in ("tcp", "rdma"):
            raise ValueError(f"mooncake protocol must be tcp or rdma, got {self.mooncake_protocol!r}")


Creator = Callable[[TransportSettings], Transport]
Suits = Callable[[TransportSettings], bool]


class Registry:
    """name -> creator, in preference order; `auto` entries that suit a process's settings
    make up its --transport auto."""

    def __init__(self) -> None:
        self._creators: dict[str, tuple[Creator, bool, Suits]] = {}

    def add(self, name: str, creator: Creator, auto: bool = True, suits: Suits = lambda s: True) -> None:
        if name in self._creators or name == "auto":
            raise ValueError(f"transport {name!r} is registered already (or reserved)")
        self._creators[name] = (creator, auto, suits)

    def names(self) -> list[str]:
        return list(self._creators)

    def auto(self, settings: TransportSettings) -> list[str]:
        return [n for n, (_, auto, suits) in self._creators.items() if auto and suits(settings)]

    def creator(self, name: str) -> Creator:
        try:
            return self._creators[name][0]
        except KeyError:
            raise ValueError(f"unknown transport {name!r}; known: auto, {', '.join(self._creators)}") from None


def _mooncake(s: TransportSettings) -> Transport:
    from transfer.transports.mooncake import MooncakeTransport  # imports mooncake: only when asked for
    return MooncakeTransport(s.host, s.mooncake_protocol, s.rdma_devices)


def _cuda_ipc(s: TransportSettings) -> Transport:
    from transfer.transports.cuda_ipc import CudaIpcTransport  # imports torch.cuda, cupy: only when asked
    return CudaIpcTransport(s.cuda_index, blocks=s.cuda_ipc_blocks)


def _on_cuda(s: TransportSettings) -> bool:
    return s.cuda_index is not None or s.device == "cuda"


TRANSPORTS = Registry()
TRANSPORTS.add("cuda-ipc", _cuda_ipc, suits=_on_cuda)
TRANSPORTS.add("mooncake", _mooncake)


def resolve(choice: str, settings: TransportSettings | None = None) -> tuple[str, ...]:
    """A --transport value -> the transport names it stands for (ValueError if unknown)."""
    if choice == "auto":
        return tuple(TRANSPORTS.auto(settings or TransportSettings()))
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
    raise TransportError(f"no common transport: peer offers {[o.kind for o in offers]}, "
                         f"we have {[t.kind for t in transports]}" + (f" ({'; '.join(why)})" if why else ""))
