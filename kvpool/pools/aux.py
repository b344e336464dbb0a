"""AUX pool: one metadata row per request (see kvpool.aux_record)."""

import numpy as np
import torch

from kvpool.aux_record import AUX_DTYPE
from kvpool.geometry import Component
from kvpool.pools.base import RequestSlotPool
from kvpool.request import RequestKV


class AuxPool(RequestSlotPool):
    component = Component.AUX

    def slot(self, req: RequestKV) -> int:
        return req.aux_row

    def write(self, row: int, room: int, num_tokens: int, first_token: int, digest: bytes) -> None:
        record = np.zeros(1, dtype=AUX_DTYPE)
        record["room"], record["num_tokens"], record["first_token"] = room, num_tokens, first_token
        record["digest"] = digest.ljust(AUX_DTYPE["digest"].itemsize, b"\0")
        raw = torch.frombuffer(bytearray(record.tobytes()), dtype=torch.uint8).reshape(1, -1)
        self.storage.scatter(np.array([row], dtype=np.int32), (raw,))

    def read(self, row: int) -> np.void:
        (raw,) = self.storage.gather(np.array([row], dtype=np.int32))
        return np.frombuffer(raw.numpy().tobytes(), dtype=AUX_DTYPE)[0]
