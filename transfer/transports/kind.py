"""What a transport declares about itself, so that adding one is its module plus one registry
line (transfer/transports/__init__.py): its name, its own frozen settings and the flags that
set them, whether it suits a process, and how it starts. The registry iterates the kinds for
the workers' flags, the --transport choices, `auto`, and create().

TransportSettings carries what every transport of a process shares (the address to bind and
advertise, the pool's device) and each kind's own settings record, found by its class; a kind
whose record is not given starts with the record's defaults (the same as its flags').

A kind's module keeps its heavy imports (mooncake, torch, cupy) inside `create`: the registry
imports every kind's module to build `disagg --help`, which must stay light.
"""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from transfer.transports.base import Transport

S = TypeVar("S")


@dataclass(frozen=True)
class NoSettings:
    """The settings of a kind that has none of its own."""


@dataclass(frozen=True)
class TransportSettings:
    """What the transports of one process need to start."""

    host: str = "127.0.0.1"  # bound and advertised
    device: str = "cpu"  # where the pool lives: cpu, cuda, cuda:N
    own: tuple = ()  # kinds' own settings records, one per kind at most (others: defaults)

    def __post_init__(self) -> None:
        classes = [type(s) for s in self.own]
        if len(set(classes)) != len(classes):
            raise ValueError(f"one settings record per transport, got {[c.__name__ for c in classes]}")

    @property
    def cuda_index(self) -> int | None:
        """The CUDA device index the pool is on (None: not on CUDA)."""
        if not self.device.startswith("cuda"):
            return None
        _, _, index = self.device.partition(":")
        return int(index) if index else None

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def of(self, cls: type[S]) -> S:
        """The record of this class given in `own`, else its defaults."""
        for s in self.own:
            if type(s) is cls:
                return s
        return cls()


def _no_flags(group: Any) -> None:
    pass


def _always(settings: TransportSettings) -> bool:
    return True


@dataclass(frozen=True)
class TransportKind(Generic[S]):
    """One transport as the registry sees it (the module docstring says why)."""

    name: str  # --transport NAME; the offers' kind
    create: Callable[[TransportSettings, S], Transport]  # imports its heavy parts when called
    settings: type[S] = NoSettings  # its frozen settings record
    add_flags: Callable[[Any], None] = _no_flags  # its flags, on an argparse group
    settings_from: Callable[[argparse.Namespace], S] | None = None  # its record from parsed flags
    suits: Callable[[TransportSettings], bool] = _always  # joins `auto` for this process?
    auto: bool = True  # part of --transport auto at all

    def own(self, args: argparse.Namespace) -> S:
        return self.settings() if self.settings_from is None else self.settings_from(args)

    def start(self, settings: TransportSettings) -> Transport:
        return self.create(settings, settings.of(self.settings))
