"""Shared fixtures. Pools are built on DISAGG_TEST_DEVICE (default: cpu); tests marked `gpu`
are deselected (not skipped) where no CUDA device exists."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("gpu") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def device() -> str:
    dev = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"DISAGG_TEST_DEVICE={dev} but torch sees no CUDA device")
    return dev
