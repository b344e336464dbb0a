"""Dtype names as they appear in specs and on the wire, and their torch counterparts."""

import torch

from kvpool.errors import SpecError

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise SpecError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize
