"""The digest that travels in TransferDone, and decode's comparison of what arrived with it:
how decode knows the bytes it holds are the bytes prefill wrote, for any engine (the model
engine's outputs can hide a flipped byte: a position the model barely attends to).

    prefill rank s, once the engine wrote:  kvpool.digest.compute -> per destination d:
                                            for_destination (the slots of the units s sends d)
    decode rank d, every TransferDone(ok):  expected (each held slot from exactly one sender)
                                            -> check against kvpool.digest.compute of the pool

On the wire, per component: raw little-endian records (uint32 slot, int64 sum). They are
untrusted: a component or slot this rank does not hold, a slot two senders report, a held
slot none reports, or a length that is not whole records is a ProtocolError naming it; only
sums that differ are a VerifyError (the request's verification failed).
"""

import hashlib

import numpy as np

from disagg.errors import ProtocolError, VerifyError
from kvpool.digest import held_slots, sent_slots, slot_name
from kvpool.geometry import Component, components
from kvpool.spec import ModelSpec

RECORD = np.dtype([("slot", "<u4"), ("sum", "<i8")])
Digest = dict[Component, np.ndarray]  # component -> int64 sums by slot (kvpool.digest.compute)


def for_destination(model: ModelSpec, sums: Digest, src: tuple[int, int], dst: tuple[int, int]) -> dict[str, bytes]:
    """The records of the slots source rank src = (tp_size, rank) sends destination rank dst."""
    out = {}
    for c, values in sums.items():
        slots = sent_slots(model, c, src, dst)
        records = np.empty(len(slots), dtype=RECORD)
        records["slot"], records["sum"] = slots, values[slots]
        out[c.value] = records.tobytes()
    return out


def expected(model: ModelSpec, tp: tuple[int, int], wires: list[dict[str, bytes]]) -> Digest:
    """The sums rank tp = (tp_size, rank) must hold, from every sender's records; ProtocolError
    where the records are not exactly one per slot it holds."""
    want: Digest = {}
    for c in _components(model, wires):
        slots = held_slots(model, c, tp)
        records = np.concatenate([_records(c, wire.get(c.value, b"")) for wire in wires] or [_records(c, b"")])
        stray = np.setdiff1d(records["slot"], slots)
        if len(stray):
            raise ProtocolError(f"digest: {c.value} slot {int(stray[0])} is not one this rank holds")
        found, counts = np.unique(records["slot"], return_counts=True)
        if (counts > 1).any():
            raise ProtocolError(f"digest: {slot_name(model, c, int(found[counts > 1][0]))} reported twice")
        missing = np.setdiff1d(slots, found)
        if len(missing):
            raise ProtocolError(
                f"digest: no sender reported {slot_name(model, c, int(missing[0]))} "
                f"({len(missing)} of {len(slots)} {c.value} units)"
            )
        sums = np.zeros(int(slots.max()) + 1, dtype=np.int64)
        sums[records["slot"].astype(np.int64)] = records["sum"]
        want[c] = sums
    return want


def _components(model: ModelSpec, wires: list[dict[str, bytes]]) -> list[Component]:
    """The model components the records must cover; a name that is not one is refused."""
    mine = [c for c in components(model) if not c.metadata]
    names = {c.value for c in mine}
    for wire in wires:
        for name in wire:
            if name not in names:
                raise ProtocolError(
                    f"digest: {str(name)[:40]!r} is not a component of this model ({', '.join(sorted(names))})"
                )
    return mine


def _records(c: Component, raw: bytes) -> np.ndarray:
    if len(raw) % RECORD.itemsize:
        raise ProtocolError(f"digest: {c.value}: {len(raw)} bytes is not whole {RECORD.itemsize}-byte records")
    return np.frombuffer(raw, dtype=RECORD)


def check(model: ModelSpec, tp: tuple[int, int], held: Digest, want: Digest) -> None:
    """VerifyError naming the first unit whose bytes differ from what its sender wrote."""
    for c, sums in want.items():
        slots = held_slots(model, c, tp)
        bad = slots[held[c][slots] != sums[slots]]
        if len(bad):
            raise VerifyError(
                f"{slot_name(model, c, int(bad[0]))}: the bytes that arrived differ from those "
                f"prefill wrote ({len(bad)} of {len(slots)} {c.value} units differ)"
            )


def summary(held: Digest) -> dict[str, str]:
    """Per component, a short hex of its sums (what a decode answer's `digests` shows)."""
    return {
        c.value: hashlib.sha256(np.ascontiguousarray(sums, dtype="<i8").tobytes()).hexdigest()[:16]
        for c, sums in held.items()
    }
