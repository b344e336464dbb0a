"""Dtype names as they appear in specs and on the wire, their sizes, and their torch
counterparts (torch is imported only when a torch dtype is asked for: a spec, a preset or a
`--help` needs names and sizes only)."""

from kvpool.errors import SpecError

ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def check(name: str) -> str:
    if name not in ITEMSIZE:
        raise SpecError(f"unknown dtype {name!r}; known: {sorted(ITEMSIZE)}")
    return name


def torch_dtype(name: str):
    import torch

    return getattr(torch, check(name))


def itemsize(name: str) -> int:
    return ITEMSIZE[check(name)]
